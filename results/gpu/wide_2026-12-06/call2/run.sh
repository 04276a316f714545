# call 2: persistent programs (lo_pers: 8 warps, 128 rows a matrix, 2 an SM; lo_pers4: 4 warps, 64 rows, 3 an SM),
# one pipeline across a program's tiles, against lo_mma.cu and lo_wide.cu
export PYTHONPATH=$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for f in src/moetide/compute/csrc/lo_mma.cu var/wide/lo_wide.cu var/pers/lo_pers.cu var/pers4/lo_pers4.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 360 python3 scripts/bench_lo_cuda.py --out $OUT/lo_pers.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 3 --against-source var/wide/lo_wide.cu,var/pers/lo_pers.cu,var/pers4/lo_pers4.cu 2>&1 | grep -v "^  " | cut -c1-400
