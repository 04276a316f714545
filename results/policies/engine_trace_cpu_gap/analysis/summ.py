import sys, json, collections, numpy as np
sys.path.insert(0, 'an'); import analyze as A
runs = {"in_step_engine_d1": "old_d1.npz", "sync_free_d1": "new_d1b.npz", "in_step_engine_d2": "old_d2.npz",
        "sync_free_d2": "new_d2.npz", "sync_free_d1_searcher_inline": "new_d1_inline.npz",
        "sync_free_d1_switch_20us": "new_d1_sw20.npz", "sync_free_d1_also_next_layer": "new_d1_ahead.npz",
        "bound_d1_feed_waited_inline": "new_d1_bound.npz", "bound_d1_feed_waited_inline_wait_for_copies": "new_d1_bound_w.npz"}
out = {}
for name, p in runs.items():
    r, _ = A.load(p)
    kinds = collections.Counter(v[0] for v in r.values())
    pred = collections.Counter(v[1] for v in r.values())
    per = [round(float(np.mean([v[0].startswith('hit') for k, v in r.items() if k[1] == l])), 3) for l in range(8)]
    cov = [round(float(np.mean([v[1] == 'before' for k, v in r.items() if k[1] == l])), 3) for l in range(8)]
    row = json.loads(str(np.load(p)["row"]))
    out[name] = {"hit_rate": row["hit_rate"], "uses": len(r), "kinds": dict(kinds), "prediction_vs_read": dict(pred),
                 "per_layer_hit_rate": per, "per_layer_predicted_before_read": cov, "tpot_mean_s": row["tpot_mean_s"]}
json.dump(out, open(sys.argv[1], "w"), indent=1)
for k, v in out.items(): print(k, v["hit_rate"], v["per_layer_hit_rate"])
