# 2026-12-06, one NVIDIA H100 80GB HBM3 (same kind, a fresh machine), tree at d966d8c with lo_mma.cu as passes.patch
# leaves it (the run's own source, "auto"), against three copies beside it, each with lo_mma_common.cuh:
#   lo_mma_base.cu  git show d966d8c:src/moetide/compute/csrc/lo_mma.cu (the committed kernel)
#   lo_mma_nopf.cu  passes.patch without loading the next token tile's activations ahead
#   lo_mma_occ.cu   passes.patch with kMinPrograms 3 for 4 token tiles (168 registers, 124 bytes spilled)
export PYTHONPATH=$PWD/src; for f in src/moetide/compute/csrc/lo_mma.cu var/lo_mma_base.cu var/lo_mma_nopf.cu var/occ/lo_mma_occ.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1]))" $f & done; wait
OUT=$OUT DEADLINE=530 AGAINST=var/lo_mma_base.cu,var/lo_mma_nopf.cu,var/occ/lo_mma_occ.cu LOPIPE_TOKENS=1,8,32,128 \
  LOPIPE_ARGS=" " TESTS_S=130 LOPIPE_S=200 DECODE_S=110 NCU_CELLS="int2:128 int2:32" NCU_S=45 bash scripts/gpu_fused.sh lopipe ncu
# the GPU tests ran out of their 130 s before pytest's summary (no failure printed before that); the decode
# line printed is the run's own source at batch 1 only (the rest ran out of DECODE_S)
