"""The machine's memory as moetide reads it: what it can spare (the default `--cpu-memory`) and this
process's resident set."""

from __future__ import annotations

import os

_MARGIN_MIN = 2 << 30
_MARGIN_SHARE = 0.10


def _meminfo() -> dict[str, int]:
    """`/proc/meminfo` in bytes ({} where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    except (OSError, ValueError):
        return {}


def available_bytes() -> int | None:
    """MemAvailable: what the kernel can give a new allocation without swapping (None where the
    machine does not say)."""
    return _meminfo().get("MemAvailable")


def machine_spare_bytes() -> int:
    """The default `--cpu-memory`: MemAvailable less max(2 GiB, 10 % of MemTotal), at least 0."""
    info = _meminfo()
    if "MemAvailable" in info:
        available, total = info["MemAvailable"], info.get("MemTotal", info["MemAvailable"])
    else:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        available = total = pages * size
    return max(0, available - max(_MARGIN_MIN, int(_MARGIN_SHARE * total)))


def rss_bytes() -> tuple[int, int]:
    """`(VmRSS, VmHWM)` of this process in bytes ((0, 0) where /proc is not there)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0
