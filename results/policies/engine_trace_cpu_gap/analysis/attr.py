import sys, collections, numpy as np
sys.path.insert(0, 'an'); import analyze as A
a, _ = A.load(sys.argv[1]); b, _ = A.load(sys.argv[2])
z = np.load(sys.argv[2]); outs = ("started", "resident", "deferred: link", "deferred: no slot", "stale")
issue = {}
for it, l, e, t, o in z["issues"]:
    k = (int(it), int(l), int(e)); issue.setdefault(k, []).append(outs[int(o)])
c = collections.Counter(); tot = collections.Counter()
for k in a.keys() & b.keys():
    ka, pa, ita, _ = a[k]; kb, pb, itb, _ = b[k]
    ha, hb = ka.startswith("hit"), kb.startswith("hit")
    if ha == hb: continue
    if pb == "before":
        o = issue.get((itb, k[1], k[2]))
        why = "timely, " + ("never issued (dropped)" if o is None else "/".join(sorted(set(o))))
    else:
        why = pb
    cls = ("old hit new miss" if ha else "new hit old miss")
    c[(cls, "old " + ("pred" if pa != "none" else "no pred"), "new " + why, kb if ha else ka)] += 1
    tot[cls] += 1
print(tot)
for k, n in c.most_common(30): print(f"{n:6d}  {k}")
