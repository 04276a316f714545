# 2026-12-06, one NVIDIA H100 80GB HBM3 (driver 580.159.04), torch 2.11.0+cu130, transformers 5.17.0,
# triton 3.6.0; the tree at 5e64da3 (lo_mma.cu, and csrc/lo_mma_pipelined.cu as the other source)
OUT=$OUT DEADLINE=570 bash scripts/gpu_fused.sh lopipe
