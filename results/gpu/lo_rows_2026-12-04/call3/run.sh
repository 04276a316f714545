#!/usr/bin/env bash
# tokens as rows: warps along K 1 vs 2 above 128 tokens
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false MOETIDE_KERNEL_CACHE=/tmp/kc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
date -u +%FT%TZ
timeout 150 python3 scripts/bench_lo_cuda.py --out "$OUT/lo_tar_wk_int4.json" --formats int4 --max-tokens 4096 \
  --tokens 160,192,256,512,2048 --tokens-as-rows-from 0 --warps-k 1,2 --reps 3 2>&1 | grep -v "^  "
timeout 150 python3 scripts/bench_lo_cuda.py --out "$OUT/lo_tar_wk_int2.json" --formats int2 \
  --tokens 160,192,256,512,2048 --tokens-as-rows-from 0 --warps-k 1,2 --reps 3 2>&1 | grep -v "^  "
echo "=== done $SECONDS"
