# call 4: lo_mma.cu with two MMA chains a group (split: even / odd k16 tiles), with token tiles in pairs (pair: one
# unpack for two tiles, four chains), and pair under a lower launch bound (pairlb: 12 / 16 warps an SM, no spill)
export PYTHONPATH=$PWD/src:$PWD/tests
for f in src/moetide/compute/csrc/lo_mma.cu var/split/lo_split.cu var/pair/lo_pair.cu var/pairlb/lo_pairlb.cu; do
  python3 -c "import sys, torch; from pathlib import Path; from moetide.compute import lo_cuda as l; \
    print(l.build('%d%d' % torch.cuda.get_device_capability(), l.nvcc(), l.cache_dir(), Path(sys.argv[1])))" $f &
done; wait
timeout 360 python3 scripts/bench_lo_cuda.py --out $OUT/lo_chains.json --tokens 1,8,32,128 --formats int2,int4 --max-tokens 4096 \
  --warps-k auto --reps 3 --against-source var/split/lo_split.cu,var/pair/lo_pair.cu,var/pairlb/lo_pairlb.cu 2>&1 | grep -v "^  " | cut -c1-400
