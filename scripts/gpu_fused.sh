#!/usr/bin/env bash
# One GPU-machine call for the fused MoE path: its tests, the per-layer kernel timings (and tuning),
# then decode tok/s and prefill TTFT against transformers' static-cache generate. Steps named in $@:
#   tests gputests tune bench zerocopy
# (no openai/pydantic on the GPU image: the server tests stay on the CPU)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null
DEADLINE=${DEADLINE:-580}
T() { local left=$((DEADLINE - SECONDS)); [ $left -lt 1 ] && left=1; if [ $left -lt $1 ]; then echo $left; else echo $1; fi; }
for step in "$@"; do
  echo "=== $step $(date +%T), $((DEADLINE - SECONDS)) s left"
  case "$step" in
    tests) timeout $(T ${TESTS_S:-150}) python3 -m pytest -q -p no:cacheprovider -x tests/test_fused_moe.py tests/test_gpu.py \
             tests/test_graphed_decode.py -k "${TESTS_K:-not under_interpreter}" 2>&1 | tail -25 ;;
    gputests) timeout $(T ${TESTS_S:-240}) python3 -m pytest -q -p no:cacheprovider tests/test_fused_moe.py -k fused_kernel 2>&1 | tail -4
             timeout $(T ${TESTS_S:-240}) python3 -m pytest -q -p no:cacheprovider -m gpu tests/ \
               --ignore=tests/test_server.py --ignore=tests/test_server_prompt.py --ignore=tests/test_server_shutdown.py \
               -x ${GPUTESTS_K:+-k "$GPUTESTS_K"} 2>&1 | tail -40 ;;
    tune)  timeout $(T ${TUNE_S:-200}) python3 scripts/tune_fused_moe.py --out "$OUT/fused_layer.json" ${TUNE_ARGS:---tokens 1,8,32,128} ;;
    bench) timeout $(T ${BENCH_S:-260}) python3 scripts/bench_decode_step.py --out "$OUT/decode_step.json" ${BENCH_ARGS:-} 2>&1 \
             | grep -v "Warn\|Loading\|it/s\]" ;;
    zerocopy) timeout $(T 60) python3 scripts/probe_zero_copy.py --out "$OUT/zero_copy.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
ls -la "$OUT"
