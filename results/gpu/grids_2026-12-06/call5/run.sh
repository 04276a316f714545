# 2026-12-06, the machine of call 4 (warm), the same tree: static-int2 decode, the run's own kernel then d966d8c's
export PYTHONPATH=$PWD/src:$PWD/tests
timeout 210 python3 scripts/bench_decode_step.py --out "$OUT/decode_resident.json" --prefill 0 --cache-dir /tmp/moetide-cache \
  --policies static-int2 --batch-sizes 1,32 --compile auto --skip-hf --env default,MOETIDE_LO_SOURCE=$PWD/var/lo_mma_base.cu
