# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree at 6969b96. Each var/<v>/lo_<v>.cu is src/moetide/compute/csrc/lo_mma.cu
# with call2/<v>.patch applied, lo_mma_common.cuh copied beside it (and patched where the patch has a second part).
# call 2: ncu per-SASS stall sampling of lo_mma.cu (int2 T=32, 128); activation prefetch one tile ahead (v6)
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/v6/lo_v6.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
for t in 128 32; do
  timeout 100 ncu --clock-control none --kernel-name regex:lo_mma_kernel --launch-skip 2 --launch-count 2 \
    --section SourceCounters --section WarpStateStats --section SchedulerStats --import-source no -o $OUT/rep_$t \
    python3 scripts/profile_lo_ncu.py --format int2 --tokens $t > $OUT/ncu_log_$t.txt 2>&1; tail -3 $OUT/ncu_log_$t.txt
  ncu -i $OUT/rep_$t.ncu-rep --page source --csv --print-source sass > $OUT/src_$t.csv 2>&1; ls -la $OUT; head -c 600 $OUT/src_$t.csv
  gzip -9 $OUT/src_$t.csv
done
rm -f $OUT/ncu_log_*
timeout 120 python3 scripts/bench_lo_cuda.py --out $OUT/lo_v6.json --tokens 8,32,128 --formats int2 --max-tokens 4096 \
  --warps-k auto --reps 2 --against-source var/v6/lo_v6.cu 2>&1 | grep -v "^  " | cut -c1-400
timeout 120 python3 scripts/bench_lo_cuda.py --out $OUT/lo_v6_b16.json --tokens 32,128 --formats int2 --max-tokens 4096 \
  --warps-k auto --reps 2 --against-source var/v6/lo_v6.cu --wide-block-m 16 2>&1 | grep -v "^  " | cut -c1-400
ls -la $OUT
