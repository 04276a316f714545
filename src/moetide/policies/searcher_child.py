"""The child end of FineMoE's searcher process (`searcher_process.py` is the forward process's end).

`child_entry` is what the child runs (`python -c`, see `searcher_process._CHILD_COMMAND`): a
`FineMoEPolicy` whose handler runs inline, fed from the shared event ring, writing its sink calls
into the decision ring. Kept apart from `searcher_process.py` so that FineMoE imports the transport
and the child imports FineMoE, and no module imports the other back.
"""

from __future__ import annotations

import mmap
import os
import select
import sys
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from .expert_map import ExpertMapStore
from .finemoe import FineMoEPolicy
from .searcher_process import (
    _C0,
    _COUNTERS,
    _CTRL,
    _DEC_APPLIED,
    _DEC_SEQ,
    _POSITION,
    _READ_SEQ,
    _READY,
    _PAUSED,
    _SLEEPING,
    _WRITE_SEQ,
    IDLE_S,
    KIND_BEGIN,
    KIND_LAYER,
    KIND_PREFETCH,
    KIND_PROTECT,
    KIND_PROTECT_PREFETCH,
    POLICY_COUNTERS,
    POLL_S,
    SLEEP_TIMEOUT_S,
    SharedRings,
    decode_position,
)


class _RingSink:
    """The child's `ExpertSink`: each call becomes a decision slot for the forward process."""

    capacity_experts = 0

    def __init__(self, rings: SharedRings, counters: dict):
        self.rings = rings
        self.counters = counters
        self.written = 0
        self.slots = rings.sizes[1]

    def _write(self, kind: int, layer: int, experts, iteration: int, priorities=None) -> None:
        rings = self.rings
        if self.written - int(rings.ctrl[_DEC_APPLIED]) >= self.slots:
            self.counters["dropped_decisions"] += 1
            return
        slot = self.written % self.slots
        n = len(experts)
        rings.dec_ids[slot, :n] = experts
        if priorities is not None:
            rings.dec_prob[slot, :n] = priorities
        rings.dec_head[slot] = (kind, iteration, layer, n)
        self.written += 1
        rings.ctrl[_DEC_SEQ] = self.written

    def protect(self, layer, experts, *, iteration) -> None:
        self._write(KIND_PROTECT, layer, experts, iteration)

    def prefetch(self, layer, experts, *, iteration, priorities=None, protect=False) -> None:
        kind = KIND_PROTECT_PREFETCH if protect else KIND_PREFETCH
        self._write(kind, layer, experts, iteration, priorities)

    def set_precision(self, layer, expert, precision) -> None:  # FineMoE never asks
        pass


def child_entry() -> None:
    """`python -c` entry of the child: descriptors in argv, everything else in the first message."""
    mem_fd, wake_fd, conn_fd = (int(a) for a in sys.argv[1:4])
    conn = Connection(conn_fd)
    _, config, geometry, sizes, state = conn.recv()
    memory = mmap.mmap(mem_fd, SharedRings.nbytes(*sizes))
    searcher_main(config, geometry, SharedRings(memory, *sizes), wake_fd, conn, state)


def _handle_event(policy, rings: SharedRings, slot: int, errors: list, H: int, J: int) -> None:
    """Hand the event in ring slot `slot` to `policy`; a failure is recorded, never raised."""
    kind, it, layer, count = rings.ev_head[slot].tolist()
    try:
        if kind == KIND_BEGIN:
            embedding = torch.from_numpy(rings.ev_data[slot, :H].copy())
            policy._handle(("begin", it, embedding, count))
        elif kind == KIND_LAYER:
            policy._handle(("layer", it, layer, rings.ev_data[slot, :J].copy(), count))
        else:
            policy._handle(("end", it))
    except Exception as e:  # noqa: BLE001 - a failed search must never take the engine down
        errors.append(f"{type(e).__name__}: {e}")
        if len(errors) <= 3:
            traceback.print_exc(file=sys.stderr)


def _handle_events(policy, rings: SharedRings, read: int, end: int, errors: list, H: int, J: int) -> int:
    """Hand the ring's events `read` .. `end` - 1 to `policy` in order (all dropped unread while
    `ctrl[PAUSED]` is set), advancing the read counter after each but the last; returns `end`. The
    caller advances it past the last once the counters are published, so that a reader who saw
    every event read (`SearcherProcess.drain`) also sees their counters."""
    S = rings.sizes[0]
    while read < end:
        slot = read % S
        if not rings.ctrl[_PAUSED]:  # paused: read and dropped (the forward side's cost alone is measured)
            _handle_event(policy, rings, slot, errors, H, J)
        read += 1
        if read < end:
            rings.ctrl[_READ_SEQ] = read
    return read


def searcher_main(config, geometry, rings: SharedRings, wake_fd: int, conn, state) -> None:
    """The child process: handle events as they come, answer control messages, exit with the parent."""
    torch.set_num_threads(1)
    L, J, top_k, H = geometry
    counters = dict.fromkeys(_COUNTERS, 0)

    class ChildSearcher(FineMoEPolicy):
        def _forward_position(self):
            return decode_position(rings.ctrl[_POSITION])

    policy = ChildSearcher(replace(config, searcher="inline"))
    policy.attach(_RingSink(rings, counters), L, J, top_k)
    policy._asynchronous = True  # searches may be late: check the forward pass's position
    if state is not None:
        policy.store = ExpertMapStore.from_state(state)
    errors: list[str] = []
    read = 0
    rings.ctrl[_READY] = 1
    last_event = time.monotonic()
    while True:
        if read < int(rings.ctrl[_WRITE_SEQ]):
            pass
        elif time.monotonic() - last_event < IDLE_S:
            time.sleep(POLL_S)
        else:
            rings.ctrl[_SLEEPING] = 1
            if read == int(rings.ctrl[_WRITE_SEQ]):
                readable, _, _ = select.select([wake_fd, conn.fileno()], [], [], SLEEP_TIMEOUT_S)
                if wake_fd in readable and not os.read(wake_fd, 65536):
                    return  # end of file: the forward process closed its end (or is gone)
            rings.ctrl[_SLEEPING] = 0
        while conn.poll():
            try:
                message = conn.recv()
            except EOFError:
                return  # the forward process is gone
            if message[0] == "stop":
                return
            if message[0] == "get_store":
                conn.send(policy.store.state() if policy.store is not None else None)
            elif message[0] == "set_store":
                policy.store = ExpertMapStore.from_state(message[1])
                policy._it = -1  # the iteration in progress continues without a match
                conn.send(len(policy.store))
            elif message[0] == "errors":
                conn.send(list(errors))
        end = int(rings.ctrl[_WRITE_SEQ])
        if read == end:
            continue
        last_event = time.monotonic()
        read = _handle_events(policy, rings, read, end, errors, H, J)
        counters.update({name: getattr(policy, name) for name in POLICY_COUNTERS})
        counters.update(
            search_ns=int(policy.search_time_s * 1e9),
            errors=len(errors),
            store_size=len(policy.store) if policy.store is not None else 0,
        )
        rings.ctrl[_C0:_CTRL] = [counters[k] for k in _COUNTERS]
        rings.ctrl[_READ_SEQ] = read  # after the counters: see `_handle_events`
