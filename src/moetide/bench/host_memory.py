"""What a benchmark run needs of this machine's host memory and disk, checked before anything is
written or loaded: a shape too large for the machine is one line naming the size it needs, not an
out-of-memory kill minutes later.

A lower bound, from the model's configuration alone (parameters counted on the meta device):
    on the CPU     every weight in the run's dtype (auto: float32), for the engine and the transformers
                   baselines alike
    on CUDA        every expert in bf16 in host memory (the engine's host store)
    synthetic      the checkpoint's bf16 bytes free on the disk it is written to (unless written)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config import format_bytes
from ..errors import ConfigError


def available_host_bytes() -> int | None:
    """Memory the kernel can give a new allocation without swapping (MemAvailable), or None where
    the machine does not say."""
    from ..store.host_ram import available_bytes

    return available_bytes()


def parameter_counts(config) -> tuple[int, int]:
    """(all parameters, expert parameters) of the model `config` describes."""
    import torch

    from ..models.loader import build_empty_model

    model = build_empty_model(config, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, experts


def check_fits(config, device: str, dtype: str, what: str, write_to: Path | None = None) -> None:
    """ConfigError when this machine's available memory is less than a run of `config` on `device`
    ("cpu", "cuda", ...) with --dtype `dtype` needs (module docstring), or, for a checkpoint still
    to be written to `write_to`, when its disk has less free than the checkpoint's bytes."""
    total, experts = parameter_counts(config)
    on_cuda = device.startswith("cuda")
    need = experts * 2 if on_cuda else total * (4 if dtype in ("auto", "float32") else 2)
    have = available_host_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"{what} needs at least {format_bytes(need)} of host memory on {device}; this machine has"
            f" {format_bytes(have)} available"
            + (
                ""
                if on_cuda
                else f" (on a CUDA GPU it needs {format_bytes(experts * 2)}: the experts in bf16)"
            )
        )
    if write_to is not None:
        folder = write_to
        while not folder.exists():
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        if total * 2 > free:
            raise ConfigError(
                f"{what} writes a {format_bytes(total * 2)} checkpoint to {write_to}; its disk has"
                f" {format_bytes(free)} free (choose another with --synthetic-dir)"
            )
