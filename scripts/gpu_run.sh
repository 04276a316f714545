#!/usr/bin/env bash
# One GPU-machine call: install carried wheels, run the GPU tests, then the benchmarks named in $@.
# Usage (device tool, carry .whl): bash scripts/gpu_run.sh tests offload server searcher bs32 eval
# kernel A/B (fused vs per-expert reference): bash scripts/gpu_run.sh lodecode
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1  # everything printed also comes back in run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/machine.txt"
MT="python3 -m moetide.cli"
DEADLINE=${DEADLINE:-570}  # seconds after the start by which every step has ended (the call's limit is 600)
T() { local left=$((DEADLINE - SECONDS)); [ $left -lt 1 ] && left=1; if [ $left -lt $1 ]; then echo $left; else echo $1; fi; }
for step in "$@"; do
  echo "=== $step $(date +%T), $((DEADLINE - SECONDS)) s left"
  [ $((DEADLINE - SECONDS)) -lt 20 ] && { echo "skipped: no time left"; continue; }
  case "$step" in
    tests)    timeout $(T 150) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ \
                --ignore tests/test_server.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" ;;
    graphtests) timeout $(T 120) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphed_decode.py \
                tests/test_policies_trace.py -k "graph or published_after" 2>&1 | tail -150 | tee "$OUT/gpu_graph_tests.log" ;;
    gpupeak)  timeout $(T 40) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k peak 2>&1 | tail -3 | tee "$OUT/gpu_peak.log" ;;
    lodecode) timeout $(T 200) python3 scripts/bench_offload.py --skip-hf --out "$OUT/offload_lo_kernel.json" \
                --policies no-offload,static-int2,combined --lo-kernel dequant,triton 2>&1 | grep -v "Warn\|Loading weights\|writing" ;;
    offload)  timeout $(T 260) python3 scripts/bench_offload.py --out "$OUT/offload_olmoe.json" --cuda-graphs auto,off \
                --policies no-offload,static-int2,combined 2>&1 | grep -v "Warn\|Loading weights\|writing" ;;
    repeat)   timeout $(T 200) python3 scripts/bench_offload.py --skip-hf --out "$OUT/offload_repeat.json" \
                --policies no-offload,no-offload,static-int2,no-offload 2>&1 | grep -v "Warn\|Loading weights\|writing" ;;
    trainstep) timeout $(T 120) python3 scripts/bench_train_step.py --out "$OUT/train_step.json" \
                --impls grouped_mm_bf16,grouped_mm --batch-sizes 128,256 2>&1 | tail -6 ;;
    offload2) timeout $(T 90) python3 scripts/bench_offload.py --skip-hf --out "$OUT/offload_lo.json" \
                --policies no-offload,static-int2 2>&1 | grep -v "Warn\|Loading weights\|writing" ;;
    server)   timeout $(T 130) python3 scripts/bench_server.py --concurrency 1 8 32 --requests-per-client 2 --output-len 64 \
                --out "$OUT/server.json" -- --policy combined --gpu-memory 1GiB 2>&1 | grep -v "loading weights" | tail -12
              pkill -f "moetide.cli serve" ; pkill -f "moetide serve" ; true ;;
    searcher) timeout $(T 200) python3 scripts/bench_searcher.py --warm 24 --prompts 12 --new-tokens 32 --out "$OUT/searcher.json" \
                2>&1 | grep -v "Warn\|Loading" | tail -50 ;;
    bs32)     timeout $(T 180) $MT bench --synthetic olmoe-1b-7b --policy combined,lru,on-demand --gpu-memory 4GiB --lo-kernel triton \
                --batch-size 32 --output-len 32 --max-input-len 128 --out "$OUT/bs32" 2>&1 | grep -v "Warn\|Loading" | tail -12 ;;
    profile)  timeout $(T 150) python3 scripts/profile_decode.py --out "$OUT/profile_bs32.json" --policies combined,static-int2 \
                --batch-size 32 --lo-kernel triton 2>&1 | grep "^{" ;;
    bs32dq)   timeout $(T 120) $MT bench --synthetic olmoe-1b-7b --policy combined --gpu-memory 4GiB --lo-kernel dequant \
                --batch-size 32 --output-len 32 --max-input-len 128 --out "$OUT/bs32dq" 2>&1 | grep -v "Warn\|Loading" | tail -12 ;;
    trace)    # the trace-driven run: held-out demo-model routing (recorded on the CPU, 48 requests x 32
              # tokens, the first 16 replayed as warm-up) onto the OLMoE expert size, 25 % of the experts
              TR=/tmp/trace_heldout.safetensors
              [ -f $TR ] || timeout $(T 120) $MT bench --record-trace $TR --num-prompts 48 --output-len 32 --max-input-len 128 2>&1 | tail -1
              for d in ${TRACE_DS:-1 2 3}; do  # TRACE_DS="2 3": only those distances
                [ $((DEADLINE - SECONDS)) -lt 30 ] && { echo "d=$d skipped: no time left"; continue; }
                timeout $(T 150) $MT bench --synthetic olmoe-1b-7b --trace $TR --gpu-memory 25% --trace-warmup 16 --prefetch-distance $d \
                  --policy finemoe,moe-infinity$([ $d = 1 ] && echo ,on-demand) --out "$OUT/trace/d$d" --quiet 2>&1 \
                  | grep -v "Warn\|Loading" | tail -8
              done ;;
    eval)     timeout $(T 60) $MT eval --max-convs 48 --out "$OUT/eval" 2>&1 | tail -16 ;;
    *) echo "unknown step $step" ;;
  esac
done
cd "$OUT" && for d in bs32 bs32dq eval trace; do [ -d $d ] && tar czf $d.tgz $d && rm -rf $d; done; ls -la "$OUT"
