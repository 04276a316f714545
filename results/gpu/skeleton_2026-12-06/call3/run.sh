# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree at 6969b96. Each var/<v>/lo_<v>.cu is src/moetide/compute/csrc/lo_mma.cu
# with call3/<v>.patch applied, lo_mma_common.cuh copied beside it (and patched where the patch has a second part).
# call 3: words and scales copied out of the load's registers at the loop top (v7): scoreboard waits, timing
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/v7/lo_v7.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f > $OUT/so_$(basename $f .cu).txt &
done; wait
for n in lo_mma lo_v7; do cuobjdump -sass $(cat $OUT/so_$n.txt) > /tmp/$n.sass; done
python3 - <<'PY' > $OUT/sass_v7.txt
import re
for n in ("lo_mma", "lo_v7"):
    keep=False
    for l in open(f"/tmp/{n}.sass"):
        if "Function :" in l:
            keep = re.search(r"ILi2ELi(2ELi2ELi2ELi2|1ELi4ELi2ELi2|2ELi4ELi2ELi2|2ELi1ELi4ELi1|1ELi1ELi4ELi1)ELb0", l) is not None
            if keep: print("#####", n, l.strip())
        if keep: print(l.rstrip())
PY
wc -c $OUT/sass_v7.txt
timeout 150 python3 scripts/bench_lo_cuda.py --out $OUT/lo_v7.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 3 --against-source var/v7/lo_v7.cu 2>&1 | grep -v "^  " | cut -c1-400
