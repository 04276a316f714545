"""Byte sizes as moetide prints them (binary units), for every layer: `config` re-exports it."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
