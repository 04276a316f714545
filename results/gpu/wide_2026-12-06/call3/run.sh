# call 3: Nsight Compute on lo_wide.cu's and lo_mma.cu's gate_up and down (int2, 32 and 128 tokens)
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/wide/lo_wide.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
KEEP="lo_(mma|wide)_kernel|Duration|Throughput|Achieved Occ|Registers|Issue Slots Busy|Issued Ipc|No Eligible|Eligible Warps|Active Warps|stalled_(long|short|wait|barrier|math|mio|lg_thr|not_sel|selected|dispatch|tex|imc|drain|branch|no_inst|sleep|membar)"
for t in 32 128; do
  for src in src/moetide/compute/csrc/lo_mma.cu var/wide/lo_wide.cu; do
    n=$(basename $src .cu)
    MOETIDE_LO_SOURCE=$src timeout 120 ncu --clock-control none --kernel-name regex:"lo_(mma|wide)_kernel" --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 scripts/profile_lo_ncu.py --format int2 --tokens $t > $OUT/ncu_${n}_$t.txt 2>&1
    echo "=== $n T=$t"; grep -E "$KEEP" $OUT/ncu_${n}_$t.txt | grep -v "^ *$" | sed -E 's/ +/ /g' | cut -c1-150 | head -70
  done
done
