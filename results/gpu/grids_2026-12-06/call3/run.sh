# 2026-12-06, the machine of call 2 (H100, warm), tree at d966d8c: the engine's cells with the floors, once more
OUT=$OUT DEADLINE=300 GRID_TESTS_K="warp_grid" TESTS_S=60 GRID_TOKENS=1,8,32,128 GRID_SPECS=auto GRIDS_S=200 DECODE_S=1 \
  GRID_SOURCES=" " bash scripts/gpu_fused.sh grids
