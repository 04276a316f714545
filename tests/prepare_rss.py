"""Run `moetide prepare` on the demo model in this process and print its RSS before and at peak (JSON).

Usage: prepare_rss.py CACHE_DIR [CPU_MEMORY]"""

import json
import sys

import torch

from moetide.engine.host_memory import rss_bytes
from moetide.engine.llm import demo_model_path
from moetide.models.prepare import prepare

torch.set_num_threads(1)
base = rss_bytes()[0]
cap = int(sys.argv[2]) if len(sys.argv) > 2 else None
prepare(str(demo_model_path()), ["int4"], cache_dir=sys.argv[1], progress=False, cpu_memory_bytes=cap)
print(json.dumps({"base": base, "peak": rss_bytes()[1]}))
