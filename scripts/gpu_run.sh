#!/usr/bin/env bash
# One GPU-machine call: install carried wheels, run the GPU tests, then the benchmarks named in $@.
# Usage (device tool, carry .whl): bash scripts/gpu_run.sh tests lowbit offload
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/machine.txt"
for step in "$@"; do
  case "$step" in
    tests)   timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_parity.py tests/test_gpu.py tests/test_quant.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log" ;;
    lowbit)  timeout 60 python3 scripts/bench_lowbit.py "$OUT/bench_lowbit.json" --sweep 2>&1 | tail -30 ;;
    offload) timeout 370 python3 scripts/bench_offload.py --out "$OUT/offload_olmoe.json" 2>&1 | tee "$OUT/offload.log" | grep -v Warn ;;
    *) echo "unknown step $step" ;;
  esac
done
