import sys, collections, numpy as np
sys.path.insert(0, 'an'); import analyze as A
b, _ = A.load(sys.argv[1]); z = np.load(sys.argv[1])
outs = ("started", "resident", "deferred: link", "deferred: no slot", "stale")
issue = collections.defaultdict(list)
for it, l, e, t, o in z["issues"]: issue[(int(it), int(l), int(e))].append((t, outs[int(o)]))
readt = {(int(a), int(c)): t for a, c, t in z["reads"]}
c = collections.Counter()
for k, (kind, pred, it, _) in b.items():
    if pred != "before": continue
    rt = readt[(it, k[1])]
    first = [x for x in issue.get((it, k[1], k[2]), []) if x[0] <= rt]
    o = first[0][1] if first else "not issued before read"
    c[(kind.split(":")[0], o, k[1] if o == "not issued before read" else -1)] += 1
for k, v in sorted(c.items()): print(v, k)
