import sys, collections, numpy as np, json
def load(p):
    z = np.load(p, allow_pickle=False)
    kinds = [str(k) for k in z["kinds"]]
    reset = int(z["reset_step"])
    uses = z["uses"]; reqs = z["requests"]; reads = z["reads"]; copies = z["copies"]
    first = {}
    for it, l, e, t, r in reqs:
        k = (int(it), int(l), int(e))
        if k not in first: first[k] = t
    readt = {(int(a), int(b)): t for a, b, t in reads}
    rows = {}
    for s, it, l, e, k, t in uses:
        if s <= reset: continue
        key = (int(s), int(l), int(e))
        rq = first.get((int(it), int(l), int(e)))
        rt = readt.get((int(it), int(l)), t)
        pred = "none" if rq is None else ("before" if rq < rt else "after")
        rows[key] = (kinds[int(k)], pred, int(it), (rt - rq) if rq is not None else None)
    return rows, kinds
def summary(rows, name):
    print(f"== {name}: {len(rows)} uses, hit {sum(r[0].startswith('hit') for r in rows.values())/len(rows):.4f}")
    c = collections.Counter((r[0], r[1]) for r in rows.values())
    for k, n in sorted(c.items()): print(f"  {k[0]:24s} pred {k[1]:7s} {n:6d}")
    L = max(k[1] for k in rows) + 1
    per = [np.mean([r[0].startswith('hit') for k, r in rows.items() if k[1] == l]) for l in range(L)]
    print("  per layer:", " ".join(f"{x:.3f}" for x in per))
if __name__ == "__main__":
    a, ka = load(sys.argv[1]); b, kb = load(sys.argv[2])
    summary(a, sys.argv[1]); summary(b, sys.argv[2])
    keys = a.keys() & b.keys()
    print("common", len(keys), "only a", len(a.keys() - b.keys()), "only b", len(b.keys() - a.keys()))
    c = collections.Counter()
    for k in keys:
        ha, hb = a[k][0].startswith("hit"), b[k][0].startswith("hit")
        if ha and not hb: c[(a[k][0], a[k][1], b[k][0], b[k][1])] += 1
    print("a hit, b miss:", sum(c.values()))
    for k, n in c.most_common(25): print(f"  {n:6d}  a={k[0]}/{k[1]}  b={k[2]}/{k[3]}")
    c2 = collections.Counter()
    for k in keys:
        ha, hb = a[k][0].startswith("hit"), b[k][0].startswith("hit")
        if hb and not ha: c2[(a[k][0], a[k][1], b[k][0], b[k][1])] += 1
    print("b hit, a miss:", sum(c2.values()))
    for k, n in c2.most_common(10): print(f"  {n:6d}  a={k[0]}/{k[1]}  b={k[2]}/{k[3]}")
def cross(a, b):
    c = collections.Counter((a[k][1], b[k][1]) for k in a.keys() & b.keys())
    print("pred old x new:", dict(c))
    L = 8
    for name, r in (("old", a), ("new", b)):
        print(name, "pred before per layer:", " ".join(f"{np.mean([v[1]=='before' for k,v in r.items() if k[1]==l]):.3f}" for l in range(L)))
        print(name, "pred none   per layer:", " ".join(f"{np.mean([v[1]=='none' for k,v in r.items() if k[1]==l]):.3f}" for l in range(L)))
