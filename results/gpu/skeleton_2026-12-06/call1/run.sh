# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree at 6969b96. Each var/<v>/lo_<v>.cu is src/moetide/compute/csrc/lo_mma.cu
# with call1/<v>.patch applied, lo_mma_common.cuh copied beside it (and patched where the patch has a second part).
# call 1: int2 'class' unpack (v1), + lean scale addressing (v15), tokens-as-rows launch bound (v4), all (v145)
export PYTHONPATH=$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name --format=csv,noheader
SRCS="src/moetide/compute/csrc/lo_mma.cu var/v1/lo_v1.cu var/v15/lo_v15.cu var/v4/lo_v4.cu var/v145/lo_v145.cu"
for f in $SRCS; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f > $OUT/so_$(basename $f .cu).txt &
done; wait
which cuobjdump nvdisasm
for n in lo_mma lo_v15; do so=$(cat $OUT/so_$n.txt); 
  cuobjdump -sass $so 2>&1 | awk '/Function :/{p=0} /Function : .*lo_mma_kernelILi2ELi2ELi2ELi2ELi2ELb0/{p=1} /Function : .*lo_mma_kernelILi2ELi1ELi4ELi2ELi2ELb0/{p=1} p' > $OUT/sass_$n.txt
  wc -l $OUT/sass_$n.txt; done
A=var/v1/lo_v1.cu,var/v15/lo_v15.cu,var/v145/lo_v145.cu
timeout 200 python3 scripts/bench_lo_cuda.py --out $OUT/lo_var.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 2 --against-source $A 2>&1 | grep -v "^  " | cut -c1-600
for v in v4 v145; do
MOETIDE_LO_SOURCE=$PWD/var/$v/lo_$v.cu timeout 100 python3 scripts/bench_lo_cuda.py --out $OUT/lo_rows_$v.json --tokens 32,64,128,256 \
  --formats int2 --max-tokens 4096 --warps-k auto --reps 2 --rows-ab 2>&1 | grep -v "^  " | cut -c1-600
done
