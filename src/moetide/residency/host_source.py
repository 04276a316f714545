"""Where a copy to the device reads an expert version in host memory.

A lo version (and a store's whole hi arena) is always there. A store that maps the checkpoint holds
hi versions only in its staged slots (`store/staging.py`): a copy of one that is only on disk is
deferred while the stager reads it in the background, except at start-up and at `deterministic`
step boundaries, where it is staged on the calling thread.
"""

from __future__ import annotations

import torch

from ..store.host_store import HostExpertStore


def staged_source(store: HostExpertStore, precision: str, layer: int, expert: int, deterministic: bool):
    """For a copy of `precision` about to take a slot: the held staged hi buffer; False while it is
    only on disk (queued for the stager: the caller defers); None where nothing needs staging now
    (not a mapped hi version, or `deterministic`: `copy_source` stages it)."""
    if precision != "hi" or not store.hi_mapped or deterministic:
        return None  # (asking the store would queue the version for the stager)
    src = store.hi_source(layer, expert)
    return False if src is None else src


def unhold(store: HostExpertStore, src) -> None:
    """The copy `staged_source` held `src` for did not start."""
    if src is not None and src is not False:
        store.staged.unhold(src)


def copy_source(store: HostExpertStore, precision: str, layer: int, expert: int, src=None) -> torch.Tensor:
    """The host buffer `(nbytes,)` a copy reads: `src` if given, else the store's (a mapped hi
    version staged on this thread if it is not yet)."""
    if src is not None:
        return src
    if precision == "hi" and store.hi_mapped:
        return store.staged.stage_now(layer, expert)  # (a staged one at once, queued for no one)
    return store.buffer(layer, expert, precision)


def fence(store: HostExpertStore, precision: str, src: torch.Tensor, event) -> None:
    """A copy from a staged slot holds the slot until `event` has completed."""
    if precision == "hi" and store.hi_mapped:
        store.staged.fence(src, event)
