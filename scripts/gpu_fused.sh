#!/usr/bin/env bash
# One GPU-machine call for the fused MoE path: its tests, the per-layer kernel timings (and tuning),
# then decode tok/s and prefill TTFT against transformers' static-cache generate. Steps named in $@:
#   tests gputests tune retune cells mixed layer lopipe grids ncu bench zerocopy decode qwen15 quant searcher trace
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
# static-int2 decode at batch 1 and 32, compiled, the run's own kernels then with $2 set: $OUT/$1.json
static_int2_ab() {
  timeout $(T ${DECODE_S:-180}) python3 scripts/bench_decode_step.py --out "$OUT/$1.json" --prefill 0 \
    --cache-dir /tmp/moetide-cache --policies static-int2 --batch-sizes 1,32 --compile auto --skip-hf \
    --env "default,$2" 2>&1 | grep "^{" | cut -c1-400
}
# Nsight Compute, with the options in $@, on the second eager call's gate_up and down of the lo kernels at
# format $f, $t tokens, programs of ${w:-4} warps (scripts/profile_lo_ncu.py)
ncu_cell() {
  MOETIDE_LO_PROGRAM_WARPS=${w:-4} timeout $(T ${NCU_S:-90}) ncu --clock-control none \
    --kernel-name regex:lo_mma_kernel --launch-skip 2 --launch-count 2 "$@" \
    python3 scripts/profile_lo_ncu.py --format $f --tokens $t
}
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
    retune) # tune RETUNE_TOKENS for every tile product, take each cell's fastest into this tree's table
            # (also returned as $OUT/fused_moe_configs.json), then decode with it at batch 1 and 32
            timeout $(T ${TUNE_S:-150}) python3 scripts/tune_fused_moe.py --out "$OUT/retune.json" --tune \
              --tokens ${RETUNE_TOKENS:-1,8,128} --variants v1,v2,v3 --formats int4,int2 --tune-seconds ${TUNE_SECONDS:-90} \
              --write-table --table-variant best 2>&1 | grep -v "^  "
            [ -f "$OUT/fused_moe_configs.json" ] && cp "$OUT/fused_moe_configs.json" src/moetide/compute/ \
              && timeout $(T ${DECODE_S:-240}) python3 scripts/bench_decode_step.py --out "$OUT/decode_retuned.json" --prefill 0 \
                --cache-dir /tmp/moetide-cache --policies ${DECODE_POLICIES:-no-offload,static-int4@6GiB,static-int2,combined} \
                --batch-sizes 1,32 --compile off,auto --skip-hf 2>&1 | grep "^{" | cut -c1-200 ;;
    cells) # TUNE_CELLS="int2:1:v3,v5:60 int2:8,32:v4,v5:80" (format:tokens:tile products:seconds): tune each,
           # each cell's fastest into this tree's table (returned as $OUT/fused_moe_configs.json)
           for cell in ${TUNE_CELLS:-int2:1:v3,v5:60}; do
             IFS=: read -r f t v s <<< "$cell"
             timeout $(T $((s + 90))) python3 scripts/tune_fused_moe.py --out "$OUT/tune_${f}_${t//,/_}.json" --tune \
               --formats $f --tokens $t --variants $v --tune-seconds $s --write-table --table-variant best 2>&1 | grep -v "^  "
             [ -f "$OUT/fused_moe_configs.json" ] && cp "$OUT/fused_moe_configs.json" src/moetide/compute/
           done ;;
    mixed) # the hi pool's tiles beside int2 lo rows (combined's layers), into this tree's table (returned as
           # $OUT/fused_moe_configs.json)
           timeout $(T ${MIXED_S:-200}) python3 scripts/tune_mixed_pools.py --out "$OUT/mixed_pools.json" \
             --tokens ${MIXED_TOKENS:-1,8,32,128} --write-table 2>&1 | grep -v "^  "
           [ -f "$OUT/fused_moe_configs.json" ] && cp "$OUT/fused_moe_configs.json" src/moetide/compute/ ;;
    layer) timeout $(T 120) python3 scripts/profile_fused_layer.py --out "$OUT/layer_kernels.json" --tokens 1,8,32,128 \
             --formats ${LAYER_FORMATS:-int2,int4,bfloat16} 2>&1 | tail -14 ;;
    lopipe) # other kernel sources (AGAINST, comma-separated; default the pipelined candidate
            # csrc/lo_mma_pipelined.cu) against lo_mma.cu: lo_mma.cu's GPU tests, one layer per (format, T) with the
            # floors, static-int2 decode with the first of them in one process
            AGAINST=${AGAINST:-src/moetide/compute/csrc/lo_mma_pipelined.cu}
            timeout $(T ${TESTS_S:-150}) python3 -m pytest -q -p no:cacheprovider -x tests/test_lo_cuda.py \
              ${LOPIPE_TESTS_K:+-k "$LOPIPE_TESTS_K"} 2>&1 | tail -12
            timeout $(T ${LOPIPE_S:-200}) python3 scripts/bench_lo_cuda.py --out "$OUT/lo_pipe.json" \
              --tokens ${LOPIPE_TOKENS:-1,8,32,128,512} --max-tokens 4096 --warps-k auto --reps 2 --against-source $AGAINST \
              ${LOPIPE_ARGS:---floor --chain 8} --kernels 2>&1 | grep -v "^  "
            static_int2_ab decode_lo_pipe "MOETIDE_LO_SOURCE=$PWD/${AGAINST%%,*}" ;;
    grids)  # programs of 4 and 8 warps (wk x wn) per (format, T) for each kernel source, with the floors
            python3 scripts/build_lo_kernels.py src/moetide/compute/csrc/lo_mma*.cu  # both at once, into the cache
            timeout $(T ${TESTS_S:-150}) python3 -m pytest -q -p no:cacheprovider -x tests/test_lo_cuda.py \
              ${GRID_TESTS_K:+-k "$GRID_TESTS_K"} 2>&1 | tail -12
            SPECS=${GRID_SPECS:-auto,1x8,2x4,4x2,2x4/1x8}
            timeout $(T ${GRIDS_S:-200}) python3 scripts/bench_lo_cuda.py --out "$OUT/lo_grids.json" \
              --tokens ${GRID_TOKENS:-1,8,32,128,512} --max-tokens 4096 --warps-k $SPECS --reps 2 --floor --chain 8 \
              2>&1 | grep -v "^  "
            static_int2_ab decode_grids MOETIDE_LO_PROGRAM_WARPS=8
            for src in ${GRID_SOURCES:-lo_mma_pipelined}; do
              MOETIDE_LO_SOURCE=$PWD/src/moetide/compute/csrc/$src.cu timeout $(T ${GRIDS_S:-200}) \
                python3 scripts/bench_lo_cuda.py --out "$OUT/lo_grids_$src.json" --tokens ${GRID_OTHER_TOKENS:-8,32,128,512} \
                --max-tokens 4096 --warps-k ${GRID_OTHER_SPECS:-auto,1x8,2x4,4x2} --reps 2 2>&1 | grep -v "^  "
            done ;;
    ncu)   # Nsight Compute on the lo kernels of one layer per NCU_CELLS cell (format:T[:program warps]): the
           # second eager call's gate_up and down (scripts/profile_lo_ncu.py), what bounds each; NCU_SOURCE=1
           # also samples each SASS instruction's stalls (src_*.csv.gz, scripts/ncu_source_stalls.py)
           KEEP="lo_mma_kernel|Duration|Throughput|L1/TEX Hit|L2 Hit|Achieved Occ|Registers|roofline|stalled_"
           for c in ${NCU_CELLS:-int2:128 int2:1}; do
             IFS=: read -r f t w <<< "$c"
             ncu_cell --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
               --section Occupancy --section LaunchStats --section SchedulerStats \
               --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
               > "$OUT/ncu_${f}_${t}_w${w:-4}.txt" 2>&1
             grep -E "$KEEP" "$OUT/ncu_${f}_${t}_w${w:-4}.txt" | head -60
             if [ -n "${NCU_SOURCE:-}" ]; then  # per-SASS warp-state samples: where each kernel waits
               rep="$OUT/src_${f}_${t}_w${w:-4}"
               ncu_cell --section SourceCounters --section WarpStateStats --import-source no -o "$rep" > /dev/null 2>&1
               ncu -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip -9 > "$rep.csv.gz"
               rm -f "$rep.ncu-rep"
               python3 scripts/ncu_source_stalls.py "$rep.csv.gz" --top 8
             fi
           done ;;
    bench) timeout $(T ${BENCH_S:-260}) python3 scripts/bench_decode_step.py --out "$OUT/decode_step.json" ${BENCH_ARGS:-} 2>&1 \
             | grep -v "Warn\|Loading\|it/s\]" ;;
    zerocopy) timeout $(T 60) python3 scripts/probe_zero_copy.py --out "$OUT/zero_copy.json" ;;
    decode) # every policy at batch 1 (4 GiB), combined and static-int2 at 1 and 32, with and without compile
            timeout $(T ${DECODE_S:-300}) python3 scripts/bench_decode_step.py --out "$OUT/decode.json" --prefill 0 \
              --cache-dir /tmp/moetide-cache --policies ${DECODE_POLICIES:-combined,static-int2} --batch-sizes 1,32 \
              --compile off,auto --hf default,static 2>&1 | grep "^{" | cut -c1-400
            timeout $(T ${DECODE_S:-200}) python3 scripts/bench_decode_step.py --out "$OUT/decode_policies.json" --prefill 0 \
              --cache-dir /tmp/moetide-cache --policies finemoe,dynaexq,lru,on-demand,moe-infinity --batch-sizes 1 \
              --skip-hf 2>&1 | grep "^{" | cut -c1-400 ;;
    qwen15) timeout $(T ${QWEN_S:-300}) python3 scripts/bench_decode_step.py --out "$OUT/decode_qwen15.json" --prefill 0 \
              --shape qwen1.5-moe-a2.7b --budget 8GiB --cache-dir /tmp/moetide-cache --policies combined \
              --batch-sizes 1 --compile off,auto --hf default 2>&1 | grep "^{" | cut -c1-400 ;;
    quant)  timeout $(T 150) python3 scripts/time_quantization.py --device cuda --checkpoint /tmp/moetide-olmoe-synth \
              --out "$OUT/quant_time_olmoe.json" 2>&1 | tail -4 ;;
    searcher) timeout $(T 200) python3 scripts/bench_searcher.py --device cuda --warm 24 --prompts ${SEARCHER_PROMPTS:-36} --new-tokens 32 \
              --out "$OUT/searcher.json" 2>&1 | grep -v "Warn\|Loading" | tail -30 ;;
    trace)  # held-out demo-model routing (48 requests x 32 tokens, the first 16 as warm-up) onto the OLMoE
            # expert size at 25 % of the experts: the engine's own residency, copies and feed decide hits
            TR=${TRACE:-/tmp/trace_heldout48.safetensors}
            [ -f $TR ] || timeout $(T 150) python3 -m moetide.cli bench --record-trace $TR --num-prompts 48 --output-len 32 \
              --max-input-len 128 2>&1 | tail -1
            for d in ${TRACE_DS:-1}; do
              timeout $(T 200) python3 -m moetide.cli bench --synthetic olmoe-1b-7b --trace $TR --gpu-memory 25% \
                --trace-warmup 16 --prefetch-distance $d --policy ${TRACE_POLICIES:-finemoe,lru,moe-infinity,on-demand} \
                --out "$OUT/trace_d$d" --quiet 2>&1 | grep -v "Warn\|Loading" | tail -8
            done ;;
    *) echo "unknown step $step" ;;
  esac
done
ls -la "$OUT"
