import sys, collections, numpy as np
sys.path.insert(0, 'an'); import analyze as A
b, _ = A.load(sys.argv[1]); z = np.load(sys.argv[1])
outs = ("started", "resident", "deferred: link", "deferred: no slot", "stale")
issue = collections.defaultdict(list)
for it, l, e, t, o in z["issues"]: issue[(int(it), int(l), int(e))].append((t, outs[int(o)]))
ev = collections.defaultdict(list)
for it, l, e, routed, parked, t in z["victims"]: ev[(int(l), int(e))].append((t, int(it), int(routed), bool(parked)))
readt = {(int(a), int(c)): t for a, c, t in z["reads"]}
c = collections.Counter(); n = 0
for k, (kind, pred, it, _) in b.items():
    if kind != "miss:evicted in step" or pred != "before": continue
    iss = [x for x in issue.get((it, k[1], k[2]), []) if x[1] == "started"]
    if not iss: continue
    t0 = iss[0][0]; rt = readt[(it, k[1])]
    evs = [x for x in ev[(k[1], k[2])] if t0 <= x[0] <= rt]
    if not evs:
        c[("started after read" if t0 > rt else "no in-step eviction between start and read")] += 1; continue
    x = evs[0]
    c[(f"evicted in step, same it {x[1]==it}, routed-layer {x[2]-k[1]}, parked {x[3]}")] += 1
for k, v in c.most_common(): print(v, k)
