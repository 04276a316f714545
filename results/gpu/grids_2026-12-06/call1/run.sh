# 2026-12-06, one NVIDIA H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0), tree at d966d8c
# + scripts/profile_lo_ncu.py and gpu_fused.sh's ncu step (committed next)
OUT=$OUT DEADLINE=560 GRID_TESTS_K="warp_grid or equal_the_reference_and" TESTS_S=100 GRID_TOKENS=1,8,32,128 \
  GRID_SPECS=auto,1x8,2x4,4x2 GRIDS_S=170 DECODE_S=90 GRID_OTHER_TOKENS=32,128 GRID_OTHER_SPECS=auto,2x4,1x8 \
  NCU_CELLS="int2:128 int2:1 int2:128:8" NCU_S=60 bash scripts/gpu_fused.sh grids ncu
# the decode A/B of the grids step ran out of its 90 s (no output)
