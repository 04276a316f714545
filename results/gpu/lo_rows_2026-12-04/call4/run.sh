#!/usr/bin/env bash
# the final rule (tokens as rows above 128 tokens, int4 on the kernels there): GPU tests, cells, 2k prefill
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false MOETIDE_KERNEL_CACHE=/tmp/kc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 4"
date -u +%FT%TZ
echo "=== tests $SECONDS"
timeout 220 python3 -m pytest -q -p no:cacheprovider $N tests/test_lo_cuda.py tests/test_graphed_decode.py tests/test_fused_moe.py \
  -k "not under_interpreter" 2>&1 | tail -6
echo "=== bench $SECONDS"
timeout 150 python3 scripts/bench_lo_cuda.py --out "$OUT/lo_final.json" --tokens 1,8,32,64,128,160,192,256,512,2048 \
  --warps-k auto --reps 3 --rows-ab 2>&1 | grep -v "^  "
echo "=== prefill $SECONDS"
left=$((570 - SECONDS)); [ $left -gt 20 ] && timeout $left python3 scripts/bench_decode_step.py --out "$OUT/prefill_ab.json" \
  --prefill 2048 --new-tokens 16 --cache-dir /tmp/moetide-cache --policies no-offload,static-int2 --batch-sizes 1 \
  --compile auto --skip-hf --env default,MOETIDE_LO_CUDA=0,default 2>&1 | grep "^{" | cut -c1-200
echo "=== done $SECONDS"
