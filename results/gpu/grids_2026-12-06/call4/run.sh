# 2026-12-06, one NVIDIA H100 80GB HBM3 (a fresh machine), tree at d966d8c with lo_mma.cu's launch bound
# `kResidentPrograms` (the run's own source; committed next, where 1 warp along K keeps the former bound)
# against var/lo_mma_base.cu = git show d966d8c:src/moetide/compute/csrc/lo_mma.cu (with lo_mma_common.cuh beside)
export PYTHONPATH=$PWD/src; for f in src/moetide/compute/csrc/lo_mma.cu var/lo_mma_base.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1]))" $f & done; wait
OUT=$OUT DEADLINE=350 AGAINST=var/lo_mma_base.cu LOPIPE_TOKENS=1,8,32,128 LOPIPE_ARGS=" " LOPIPE_TESTS_K="not pipelined" \
  TESTS_S=100 LOPIPE_S=120 DECODE_S=110 bash scripts/gpu_fused.sh lopipe
# the decode A/B of the step ran out of its 110 s after the run's own batch 1 (call 5 repeats it)
