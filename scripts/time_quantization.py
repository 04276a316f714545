"""Time the engine's quantizer on an OLMoE-1B-7B-shaped checkpoint: every expert to int4 and int2.

Builds (or reuses, when --checkpoint already holds one of the same shape) a random-weight checkpoint
of the real shapes (`bench.synthetic`, olmoe-1b-7b: 16 layers, 64 experts, H 2048, I 1024), loads its
experts into the host store exactly as `moetide prepare` does (`models.loader.load_weights`), then
times `HostExpertStore.add_precision(precision, device=...)`, the call `store.prepare.ensure_precision`
makes (quantized on the device, batch by batch, packed rows copied back to host memory). Writes a
JSON with the seconds per format, the total and the set-up times to --out.

    # the full shape on a GPU (target: int4 + int2 <= 30 s)
    python scripts/time_quantization.py --device cuda --checkpoint /tmp/olmoe-synth \
        --out results/gpu/quant_time.json
    # a quick CPU check: one layer
    python scripts/time_quantization.py --device cpu --layers 1 --checkpoint /tmp/olmoe-synth-1 \
        --out /tmp/quant_time.json

Random weights (Gaussian, std 0.02) cost the quantizer what trained ones do: its work does not
depend on the values (fixed clip ratios and refit passes).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _has_checkpoint(path: Path, layers: int, experts: int) -> bool:
    config = path / "config.json"
    if not config.is_file() or not list(path.glob("*.safetensors")):
        return False
    c = json.loads(config.read_text())
    return c.get("num_hidden_layers") == layers and c.get("num_experts") == experts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=16, help="MoE layers (16 = the full OLMoE-1B-7B)")
    p.add_argument("--experts", type=int, default=64, help="experts per layer (64 = OLMoE-1B-7B)")
    p.add_argument("--formats", default="int4,int2", help="comma-separated low-bit formats to time")
    p.add_argument("--checkpoint", default="/tmp/moetide-olmoe-synth", help="where to write/reuse it")
    p.add_argument("--out", required=True, help="JSON output path")
    args = p.parse_args(argv)

    from moetide.bench.synthetic import write_synthetic_checkpoint
    from moetide.models.loader import load_weights

    path = Path(args.checkpoint)
    t0 = time.perf_counter()
    reused = _has_checkpoint(path, args.layers, args.experts)
    if not reused:
        write_synthetic_checkpoint(
            "olmoe-1b-7b",
            path,
            progress=False,
            num_hidden_layers=args.layers,
            num_experts=args.experts,
            vocab_size=1024,  # the embeddings are not quantized; a small vocabulary writes faster
        )
    write_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    store = load_weights(path, device="cpu", dtype="bfloat16", progress=False).store
    load_s = time.perf_counter() - t0

    device = args.device
    if device.startswith("cuda"):  # warm-up: CUDA context and kernels, not counted
        warm = torch.randn(64, 1024, device=device)
        from moetide.store import quant

        quant.quantize(warm, 2, 128)
        quant.quantize(warm, 4, 64)
        _sync(device)

    seconds = {}
    for precision in [f.strip() for f in args.formats.split(",") if f.strip()]:
        _sync(device)
        t0 = time.perf_counter()
        store.add_precision(precision, device=None if device == "cpu" else device)
        _sync(device)
        seconds[precision] = time.perf_counter() - t0
        print(f"{precision}: {seconds[precision]:.2f} s", file=sys.stderr, flush=True)
        del store.versions[precision]  # host memory: one lo arena at a time

    shape = store.shape
    weights = store.num_layers * store.num_experts * 3 * shape.intermediate * shape.hidden
    record = {
        "shape": "olmoe-1b-7b",
        "layers": store.num_layers,
        "experts": store.num_experts,
        "hidden": shape.hidden,
        "intermediate": shape.intermediate,
        "expert_weights": weights,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "host": platform.node(),
        "seconds": seconds,
        "total_seconds": sum(seconds.values()),
        "weights_per_second": {k: weights / v for k, v in seconds.items()},
        "checkpoint_reused": reused,
        "checkpoint_write_seconds": write_s,
        "load_seconds": load_s,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps({"seconds": seconds, "total_seconds": record["total_seconds"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
