import sys, collections, numpy as np
def reqsets(p):
    z = np.load(p); reset = int(z["reset_step"]); step_of = dict(map(tuple, z["step_of"].tolist()))
    readt = {(int(a), int(b)): t for a, b, t in z["reads"]}
    sets = collections.defaultdict(list)  # (step, layer) -> list of (t, experts)
    cur = {}
    for it, l, e, t, r in z["requests"]:
        it, l = int(it), int(l)
        s = step_of.get(it)
        if s is None or s <= reset: continue
        if r == 0: sets[(s, l)].append((t - readt.get((it, l), np.nan), []))
        sets[(s, l)][-1][1].append(int(e))
    used = collections.defaultdict(set)
    for s, it, l, e, k, t in z["uses"]:
        if s > reset: used[(int(s), int(l))].add(int(e))
    return sets, used
a, ua = reqsets(sys.argv[1]); b, ub = reqsets(sys.argv[2])
L = 8
for name, S, U in (("old", a, ua), ("new", b, ub)):
    print(name)
    for l in range(L):
        keys = [k for k in U if k[1] == l]
        has = [k for k in keys if k in S]
        nreq = [len(S[k]) for k in has]
        size = [len(S[k][0][1]) for k in has]
        late = [S[k][0][0] > 0 for k in has]
        print(f"  layer {l}: steps {len(keys)} with request {len(has)} ({len(has)/len(keys):.3f}) req/step {np.mean(nreq):.2f} first size {np.mean(size):.2f} first late {np.mean(late):.3f}")
# same steps: compare first request sets
same = diff = 0; jacc = []
for k in a.keys() & b.keys():
    sa, sb = set(a[k][0][1]), set(b[k][0][1])
    jacc.append(len(sa & sb) / len(sa | sb))
print("both requested", len(a.keys() & b.keys()), "mean jaccard first", np.mean(jacc), "exact", np.mean(np.array(jacc) == 1))
print("old only", len(a.keys() - b.keys()), "new only", len(b.keys() - a.keys()))
