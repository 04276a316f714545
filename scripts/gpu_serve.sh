#!/usr/bin/env bash
# One GPU-machine call for the serving engine: the real `moetide serve` under 32 and 64 streaming
# clients (held-out ShareGPT prompts), the prefix probe, and the same levels served by other versions'
# source trees in the same call. Steps named in $@:
#   gputests   the paged-KV / graphed-decode GPU tests (or those of TEST_FILES)
#   demo       the demo model, combined at 1 GiB (the setting of the first serving run)
#   olmoe      the OLMoE-1B-7B shape (random weights, a word tokenizer: the prompts' words go as token
#              ids, `--word-ids`), combined at 4 GiB, with the prefix and long-prompt probes
#   olmoe_kv   the same at 64 clients for each KV reservation in KV_TOKENS (e.g. "4096 8192")
# BASELINES: source trees to A/B against (each a directory holding a `moetide` package), at 32
# clients (DEMO_BASELINES, if set, for the demo step). Needs fastapi/uvicorn/pydantic carried as wheels in .whl (the image has none of them).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, fastapi, uvicorn; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fastapi', fastapi.__version__)"
DEADLINE=${DEADLINE:-585}
T() { local left=$((DEADLINE - SECONDS)); [ $left -lt 1 ] && left=1; if [ $left -lt $1 ]; then echo $left; else echo $1; fi; }
DEMO=$PWD/src/moetide/demo_model
OLMOE=/tmp/moetide-synthetic/olmoe-1b-7b
LEVEL_ARGS="--requests-per-client ${RPC:-2} --output-len ${OUTPUT_LEN:-64} --warmup-requests 2"
# the long-prompt probe: a ~2k-token prompt joins 16 clients of short requests (LONG_TOKENS=0: off)
LONG_ARGS="--long-probe-tokens ${LONG_TOKENS:-2000} --long-probe-clients 16"
SERVE_EXTRA=${SERVE_EXTRA:-}  # more `moetide serve` options for this tree's server (e.g. --kv-cache-tokens)
for base in ${BASELINES:-}; do  # a source tree without the package data: take this tree's
  for d in demo_model data; do [ -e "$base/moetide/$d" ] || cp -r "src/moetide/$d" "$base/moetide/$d"; done
done
serve() {  # serve NAME SECONDS BENCH-ARGS... -- SERVE-ARGS...   (the server's step log: $OUT/NAME.steps.jsonl)
  local name=$1 secs=$2; shift 2
  MOETIDE_STEP_LOG="$OUT/$name.steps.jsonl" timeout $(T $secs) python3 scripts/bench_server.py --out "$OUT/$name.json" "$@" 2>&1 \
    | grep -v "loading weights\|it/s\]\|Warn" | tail -9
  pkill -f "moetide.cli serve" ; sleep 1
  python3 scripts/step_log.py "$OUT/$name.steps.jsonl" 2>&1 | tail -16 ; true
}
synthetic_olmoe() {  # the OLMoE-shape checkpoint (random weights), written once per machine
  [ -f $OLMOE/model.safetensors.index.json ] || timeout $(T 120) python3 -c \
    "from moetide.bench.synthetic import write_synthetic_checkpoint as w; w('olmoe-1b-7b', '$OLMOE', progress=False)"
}
for step in "$@"; do
  echo "=== $step $(date +%T), $((DEADLINE - SECONDS)) s left"
  case "$step" in
    gputests) timeout $(T ${TESTS_S:-150}) python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore --show-capture=no \
                ${TEST_FILES:-tests/test_paged_kv.py tests/test_graphed_decode.py} ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -40 ;;
    demo)
      serve demo_serve 150 --concurrency 32 64 $LEVEL_ARGS --prefix-probe-tokens 1000 -- \
        --model $DEMO --policy combined --gpu-memory 1GiB --max-num-seqs 64
      for base in ${DEMO_BASELINES-${BASELINES:-}}; do
        serve "demo_serve_$(basename $(dirname $base))" 100 --server-src $base --concurrency 32 $LEVEL_ARGS -- \
          --model $DEMO --policy combined --gpu-memory 1GiB --max-num-seqs 64
      done ;;
    olmoe)
      synthetic_olmoe
      serve olmoe_serve 220 --endpoint completions --word-ids 50304 --concurrency 32 64 $LEVEL_ARGS --prefix-probe-tokens 1000 \
        $LONG_ARGS -- --model $OLMOE --policy combined --gpu-memory 4GiB --max-num-seqs 64 --cache-dir /tmp/moetide-cache $SERVE_EXTRA
      for base in ${BASELINES:-}; do
        name=$(basename $(dirname $base)); cache=""  # an older version may not take --cache-dir
        grep -q -- '"--cache-dir"' $base/moetide/cli.py && cache="--cache-dir /tmp/moetide-cache-$name"
        serve "olmoe_serve_$name" 170 --server-src $base --endpoint completions --word-ids 50304 --concurrency 32 \
          $LEVEL_ARGS $LONG_ARGS -- --model $OLMOE --policy combined --gpu-memory 4GiB --max-num-seqs 64 $cache
      done ;;
    olmoe_kv) # 64 clients with a KV reservation of KV_TOKENS tokens (no probes): the KV / expert-cache trade
      synthetic_olmoe
      for kv in ${KV_TOKENS:-8192}; do
        serve "olmoe_serve_kv$kv" 120 --endpoint completions --word-ids 50304 --concurrency 64 $LEVEL_ARGS -- \
          --model $OLMOE --policy combined --gpu-memory 4GiB --max-num-seqs 64 --cache-dir /tmp/moetide-cache \
          --kv-cache-tokens $kv
      done ;;
    prefill) # where a prefill step's time goes, in one process (no server)
      synthetic_olmoe
      timeout $(T ${PREFILL_S:-240}) python3 scripts/profile_prefill.py --out "$OUT/prefill.json" \
        --config demo:combined:1GiB --config $OLMOE:combined:4GiB --config $OLMOE:static-int2:4GiB \
        --config $OLMOE:no-offload 2>&1 | grep "^{" ;;
    *) echo "unknown step $step" ;;
  esac
done
ls -la "$OUT"
