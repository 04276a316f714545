# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree at 6969b96. Each var/<v>/lo_<v>.cu is src/moetide/compute/csrc/lo_mma.cu
# with call4/<v>.patch applied, lo_mma_common.cuh copied beside it (and patched where the patch has a second part).
# call 4: each lane's words through its own cp.async ring in shared memory, 4 (v8) or 8 (v8s8) groups deep
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/v8/lo_v8.cu var/v8s8/lo_v8s8.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 200 python3 scripts/bench_lo_cuda.py --out $OUT/lo_v8.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 3 --against-source var/v8/lo_v8.cu,var/v8s8/lo_v8s8.cu 2>&1 | grep -v "^  " | cut -c1-400
