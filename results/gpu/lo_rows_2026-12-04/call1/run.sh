#!/usr/bin/env bash
# tokens-as-rows main loop: GPU tests, per-layer A/B of both loops and of the committed source, decode
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false MOETIDE_KERNEL_CACHE=/tmp/kc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 4"
date -u +%FT%TZ
echo "=== tests $SECONDS"
timeout 200 python3 -m pytest -q -p no:cacheprovider $N tests/test_lo_cuda.py tests/test_graphed_decode.py 2>&1 | tail -25
echo "=== bench $SECONDS"
timeout 260 python3 scripts/bench_lo_cuda.py --out "$OUT/lo_rows.json" --tokens ${TOK:-1,8,32,48,64,96,128,192,256,512,2048} \
  --warps-k auto --reps 3 --rows-ab --against-source devrun/head_lo_mma.cu 2>&1 | grep -v "^  "
echo "=== decode $SECONDS"
left=$((560 - SECONDS)); [ $left -gt 20 ] && timeout $left python3 scripts/bench_decode_step.py --out "$OUT/decode_int2.json" --prefill 0 \
  --cache-dir /tmp/moetide-cache --policies static-int2 --batch-sizes 1,32 --compile auto --skip-hf \
  --env default,MOETIDE_LO_CUDA=0 2>&1 | grep "^{" | cut -c1-300
echo "=== done $SECONDS"
