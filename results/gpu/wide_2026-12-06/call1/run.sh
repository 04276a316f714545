# call 1: lo_wide (8-warp programs of 128 rows a matrix, 4-group cp.async stages, 2 programs an SM where
# they fit, 128 registers) and lo_wide1 (one program an SM's registers) against lo_mma.cu, int2 and int4
export PYTHONPATH=$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for f in src/moetide/compute/csrc/lo_mma.cu var/wide/lo_wide.cu var/wide1/lo_wide1.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 300 python3 scripts/bench_lo_cuda.py --out $OUT/lo_wide.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 3 --floor --against-source var/wide/lo_wide.cu,var/wide1/lo_wide1.cu 2>&1 | grep -v "^  " | cut -c1-400
