# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree at 6969b96. Each var/<v>/lo_<v>.cu is src/moetide/compute/csrc/lo_mma.cu
# with call7/<v>.patch applied, lo_mma_common.cuh copied beside it (and patched where the patch has a second part).
# call 7: programs that run 2 or 4 tiles of rows in turn (vr2, vr4; gate_up at 4 token tiles keeps one;
# vr4all: that one too), against lo_mma.cu; then lo_mma.cu's GPU tests with vr4 in its place
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/vr2/lo_vr2.cu var/vr4/lo_vr4.cu var/vr4all/lo_vr4all.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 100 python3 scripts/bench_lo_cuda.py --out $OUT/lo_rowtiles.json --tokens 1,8,32,128 --formats int2 --max-tokens 4096 \
  --warps-k auto --reps 2 --against-source var/vr2/lo_vr2.cu,var/vr4/lo_vr4.cu,var/vr4all/lo_vr4all.cu 2>&1 | grep -v "^  " | cut -c1-300
cp var/vr4/lo_vr4.cu src/moetide/compute/csrc/lo_mma.cu && cp var/vr4/lo_mma_common.cuh src/moetide/compute/csrc/
timeout 110 python3 -m pytest -q -p no:cacheprovider -x tests/test_lo_cuda.py -k "not pipelined" 2>&1 | tail -4
