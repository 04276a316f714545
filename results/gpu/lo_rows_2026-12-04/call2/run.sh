#!/usr/bin/env bash
# where each main loop wins: int4 on the kernels at every T, both loops; int2 at large T; warps along K
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false MOETIDE_KERNEL_CACHE=/tmp/kc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u +%FT%TZ
echo "=== int4 $SECONDS"
timeout 200 python3 scripts/bench_lo_cuda.py --out "$OUT/lo_int4_all_t.json" --formats int4 --max-tokens 4096 \
  --tokens 33,48,64,96,128,160,192,224,256 --tokens-as-rows-from 0 --warps-k auto,1,4 --reps 3 --rows-ab 2>&1 | grep -v "^  "
echo "=== int2 $SECONDS"
timeout 200 python3 scripts/bench_lo_cuda.py --out "$OUT/lo_int2_rows.json" --formats int2 \
  --tokens 64,128,256,384,768,1024,1536 --tokens-as-rows-from 0 --warps-k auto,1,4 --reps 3 --rows-ab 2>&1 | grep -v "^  "
echo "=== done $SECONDS"
