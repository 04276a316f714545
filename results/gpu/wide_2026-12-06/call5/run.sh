# call 5: lo_wk (lo_wide with 2 warps along K x 4 along N: 64 rows a matrix, two programs an SM at 128 registers,
# token tiles in passes of 2) against lo_mma.cu; then Nsight Compute on lo_wk at 32 and 128 tokens
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/wk/lo_wk.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 200 python3 scripts/bench_lo_cuda.py --out $OUT/lo_wk.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 3 --against-source var/wk/lo_wk.cu 2>&1 | grep -v "^  " | cut -c1-400
KEEP="_kernel<|Duration|DRAM Throughput|No Eligible|Active Warps Per Scheduler|Eligible Warps Per|Achieved Occupancy|stalled_(long_scoreboard|wait|math_pipe|short_scoreboard|barrier|not_selected|mio)"
for t in 32 128; do
  MOETIDE_LO_SOURCE=var/wk/lo_wk.cu timeout 100 ncu --clock-control none --kernel-name regex:"lo_wk_kernel" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/profile_lo_ncu.py --format int2 --tokens $t > $OUT/ncu_lo_wk_$t.txt 2>&1
  echo "=== lo_wk T=$t"; grep -E "$KEEP" $OUT/ncu_lo_wk_$t.txt | sed -E 's/ +/ /g;s/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio inst//' | cut -c1-110
done
