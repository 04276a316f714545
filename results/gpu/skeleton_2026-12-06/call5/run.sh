# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree at 6969b96. Each var/<v>/lo_<v>.cu is src/moetide/compute/csrc/lo_mma.cu
# with call5/<v>.patch applied, lo_mma_common.cuh copied beside it (and patched where the patch has a second part).
# call 5: what the access pattern costs: lo_mma.cu with no math (ro: words and scales; roact: + activations;
# roseq: ro's bytes read as contiguous 512-byte pieces per group of a 16-row tile), against the full kernel
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/ro/lo_ro.cu var/roact/lo_roact.cu var/roseq/lo_roseq.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 200 python3 scripts/bench_lo_cuda.py --out $OUT/lo_ro.json --tokens 1,8,32,128 --formats int2 --max-tokens 4096 \
  --warps-k auto --reps 3 --floor --against-source var/ro/lo_ro.cu,var/roact/lo_roact.cu,var/roseq/lo_roseq.cu 2>&1 | grep -v "^  " | cut -c1-500
