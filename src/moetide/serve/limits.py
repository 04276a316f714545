"""The server's default request limits and its loopback test (no web stack, no torch: `moetide serve
--help` reads them)."""

from __future__ import annotations

import ipaddress

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_READ_TIMEOUT_S = 30.0


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
