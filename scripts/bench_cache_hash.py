"""What checking a prepared cache's content hash costs at load, for a model shape.

Writes a prepared-cache file of the shape's lo precision (random codes: the hash's cost depends on
the bytes only) with `store.checked_file.save_checked`, then times, `--repeats` times each, on a warm
page cache:
    read_s    the arena read without the check (safetensors' get_tensor, which maps the file) and
              copied once, as `HostExpertStore.load_precision` copies it into the store's arena
    load_s    the same as `store.prepare.load_cached` does it: the copy then hashed, every chunk on
              HASH_THREADS threads
    hash_s    the hash alone, of an arena in memory (`tensor_digest`)
and writes the medians, the file's bytes and the machine to JSON. The check's cost at load is
load_s - read_s (and hash_s bounds it). The cache file goes to --dir (a temporary directory by
default) and is deleted afterwards.

    python scripts/bench_cache_hash.py --shape olmoe-1b-7b --precision int2 --out $OUT/cache_hash.json
    python scripts/bench_cache_hash.py --demo --out results/cache_hash_cpu_demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from moetide.bench.synthetic import SHAPES, synthetic_config
from moetide.models.registry import get_adapter
from moetide.store import quant
from moetide.store.checked_file import (
    HASH_CHUNK_BYTES,
    HASH_THREADS,
    check_tensor,
    open_checked,
    save_checked,
    tensor_digest,
)


def model_shape(args) -> tuple[str, object]:
    if args.demo:
        from transformers import AutoConfig

        from moetide.engine.llm import demo_model_path

        return "demo", AutoConfig.from_pretrained(demo_model_path())
    return args.shape, synthetic_config(args.shape)


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    parser.add_argument("--demo", action="store_true", help="the embedded demo model's shape instead")
    parser.add_argument("--precision", default="int2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the cache file is written (default: a temp dir)")
    parser.add_argument("--out", required=True, help="JSON written here")
    args = parser.parse_args()
    name, config = model_shape(args)
    adapter = get_adapter(config.model_type)
    layers, experts = config.num_hidden_layers, adapter.num_experts(config)
    meta = quant.expert_layout(
        args.precision, adapter.expert_intermediate(config), config.hidden_size, torch.bfloat16
    )
    arena = torch.randint(
        0, 256, (layers * experts, meta.nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / f"{args.precision}-bench.safetensors"
        start = time.perf_counter()
        save_checked({"arena": arena}, path, {"precision": args.precision})
        write_s = time.perf_counter() - start

        def read():
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                f.get_tensor("arena").clone()

        read_s = timed(read, args.repeats)

        def load():  # as store/prepare.py's load_cached: map, copy into the store, hash the copy
            tensors, record = open_checked(path)
            check_tensor(record, "arena", tensors["arena"].clone())

        load_s = timed(load, args.repeats)
        hash_s = timed(lambda: tensor_digest(arena), args.repeats)
        file_bytes = path.stat().st_size
    report = {
        "shape": name, "precision": args.precision, "layers": layers, "experts": experts,
        "bytes_per_expert": meta.nbytes, "cache_bytes": file_bytes, "write_s_with_hash": write_s,
        "read_s": read_s, "load_s": load_s, "hash_s": hash_s, "check_s": load_s - read_s,
        "hash_gib_per_s": arena.numel() / hash_s / 2**30, "hash_threads": HASH_THREADS,
        "hash_chunk_bytes": HASH_CHUNK_BYTES, "repeats": args.repeats, "machine": platform.node(),
        "cpus": os.cpu_count(), "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(
        f"{name} {args.precision}: {file_bytes / 2**20:.1f} MiB; read {read_s:.3f} s, read + check {load_s:.3f} s"
        f" (check {load_s - read_s:+.3f} s), hash alone {hash_s:.3f} s ({report['hash_gib_per_s']:.2f} GiB/s,"
        f" {HASH_THREADS} threads)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
