import sys, numpy as np
for p in sys.argv[1:]:
    z = np.load(p); reset = int(z["reset_step"]); step_of = dict(map(tuple, z["step_of"].tolist()))
    readt = {(int(a), int(b)): t for a, b, t in z["reads"]}
    first = {}
    for it, l, e, t, r in z["requests"]:
        k = (int(it), int(l))
        if r == 0 and k not in first: first[k] = t
    win, lat, lat_all = [], [], []
    for (it, l), t in readt.items():
        if l == 0 or step_of.get(it, -1) <= reset: continue
        prev = readt.get((it, l - 1))
        if prev is None: continue
        win.append(t - prev)
        if (it, l) in first: lat.append(first[(it, l)] - prev)
    win, lat = np.array(win) * 1e3, np.array(lat) * 1e3
    q = [10, 50, 90, 99]
    print(p, "window ms (read l-1 -> read l) pct", q, np.percentile(win, q).round(3))
    print(p, "request for l after read l-1, ms", np.percentile(lat, q).round(3), "n", len(lat))
