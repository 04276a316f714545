"""The residency core's device table (step-table mode): what every layer of a sync-free step reads.

DynaExq's versioned-handle invariant, held by the table: a step only ever reads complete versions
(a copy is published only after its event), and a slot is reused only after every step that could
read its old version has finished (the compute marker of the last such step). A hypothesis state
machine drives copies, evictions, precision changes and steps on the CPU backend (copies on a
worker thread at a simulated bandwidth, each destination poisoned first) while up to two steps are
"in flight": a step's reads happen only when it completes, after later steps have been planned, as
on a GPU that lags the host. Any read of a partial or reused slot shows up as poison or as weights
that are not the version the table named.

The layer feed's part (`in_step`) runs within the newest step: the device has reached it (every
older step is done), its layers before the routed one have been read, and the residency may start
prefetches for the later ones, taking the slots only the finished layers (or parked versions) held.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from residency_setup import EXPERTS, LAYERS, expected_weights, make_manager, read_entry

from moetide.compute.expert_compute import wait_for_landing
from moetide.residency.slot_table import UNUSED, WAITED
from moetide.residency.table import DeviceTable
from moetide.residency.transfer import CpuTransfer, ThreadEvent

IN_FLIGHT = 2


class LaggingTransfer(CpuTransfer):
    """CPU copies, and compute markers that complete only when the test says the step has run."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.markers: list[ThreadEvent] = []

    def compute_marker(self) -> ThreadEvent:
        event = ThreadEvent()
        self.markers.append(event)
        return event


class DeviceTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = None
        self.iteration = 0
        # (table written at its start, marker, [layers read so far], iteration): layers read in order
        self.in_flight: list[tuple[np.ndarray, ThreadEvent, list[int], int]] = []

    @rule(
        mode=st.sampled_from(["hi-cache", "lo+hi"]),
        hi_slots=st.integers(2, 6),
        wait=st.booleans(),
    )
    @precondition(lambda self: self.manager is None)
    def start(self, mode, hi_slots, wait):
        on_miss = "zero-copy" if mode == "hi-cache" else "lo"
        lo_slots = LAYERS * EXPERTS if mode == "lo+hi" else 0
        manager = make_manager(mode, hi_slots, lo_slots, on_miss=on_miss, bandwidth=5e7, wait_for_copies=wait)
        manager.transfer.close()
        manager.transfer = LaggingTransfer(bandwidth_bytes_per_s=5e7, poison=True)
        manager.in_step_fed = True  # a layer feed drives it: begin_step parks a reserve
        self.manager = manager

    @rule(
        layer=st.integers(0, LAYERS - 1),
        experts=st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=4),
    )
    @precondition(lambda self: self.manager is not None)
    def prefetch(self, layer, experts):
        self.manager.prefetch(layer, experts, iteration=self.iteration)

    @rule(layer=st.integers(0, LAYERS - 1), expert=st.integers(0, EXPERTS - 1), hi=st.booleans())
    @precondition(lambda self: self.manager is not None)
    def set_precision(self, layer, expert, hi):
        self.manager.set_precision(layer, expert, "hi" if hi else "lo")

    @rule(used=st.lists(st.tuples(st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1)), max_size=6))
    @precondition(lambda self: self.manager is not None)
    def step(self, used):
        m = self.manager
        self.iteration += 1
        m.begin_step(self.iteration)
        # what this step's layers read: the host's table, plus any copy that published itself since
        table = m.table.device_table.clone().numpy()
        m.end_step()
        self.in_flight.append((table, m.transfer.markers[-1], [0], self.iteration))
        ran = np.full((LAYERS, EXPERTS), UNUSED, dtype=np.int32)
        for layer, expert in used:
            ran[layer, expert] = table[layer, 0, expert]
        m.observe_step(ran, self.iteration)
        if len(self.in_flight) > IN_FLIGHT:
            self._complete_oldest()

    @rule()
    @precondition(lambda self: self.manager is not None and self.in_flight)
    def complete_oldest(self):
        self._complete_oldest()

    @rule(
        routed=st.integers(0, LAYERS - 1),
        used=st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=3),
        ahead=st.integers(1, LAYERS - 1),
        experts=st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=4),
    )
    @precondition(lambda self: self.manager is not None and self.in_flight)
    def within_the_newest_step(self, routed, used, ahead, experts):
        """The device reaches the newest step's layer `routed`: older steps are done, this step's
        earlier layers have been read; then the policies ask for a later layer and `in_step` acts."""
        while len(self.in_flight) > 1:
            self._complete_oldest()
        entry = self.in_flight[0]
        progress = entry[2]
        if routed < progress[0]:
            return
        self._read(self._table_of(entry), range(progress[0], routed))
        progress[0] = routed
        if routed + ahead < LAYERS:
            self.manager.prefetch(routed + ahead, experts, iteration=self.iteration)
        self.manager.in_step(self.iteration, routed, np.array(used))

    def _complete_oldest(self):
        """The oldest step runs now: read the rest of its experts through its table."""
        entry = self.in_flight.pop(0)
        self._read(self._table_of(entry), range(entry[2][0], LAYERS))
        entry[1].set()

    def _table_of(self, entry) -> np.ndarray:
        """What a step's next layers read: the table as it is now while it is the newest step (with
        whatever copies and in-step decisions have written into it since it began), else the table
        its start wrote (the later steps' writes come after it in stream order)."""
        table, _marker, _progress, iteration = entry
        return self.manager.table.device_table.clone().numpy() if iteration == self.iteration else table

    def _read(self, table, layers):
        """Read every expert of `layers` through `table` and check the weights; an entry that names a
        copy in flight (wait_for_copies) is read once the slot's landed word says it landed, as the
        kernel's programs wait for it (a copy that never lands fails the wait)."""
        pools = self.manager.kernel_pools(torch.float32)
        names = {v: k for k, v in self.manager.pool_ids.items()}
        wait_row = self.manager.table.wait_row
        for layer in layers:
            for expert in range(EXPERTS):
                pool_id = int(table[layer, 0, expert])
                slot = int(table[layer, 1 + pool_id, expert])
                assert pool_id >= 0, "an expert the table sends nowhere"
                if int(table[layer, wait_row, expert]):
                    wait_for_landing(self.manager.table.landed, slot, int(table[layer, wait_row, expert]))
                gate_up, _ = pools[pool_id].weights(slot, torch.float32)
                assert torch.isfinite(gate_up).all(), "read a poisoned (partially written) slot"
                name = names[pool_id]
                precision = self.manager.precision_of(name)
                want = expected_weights(layer, expert, precision, self.manager.store)
                assert torch.equal(gate_up, want), f"{name} slot {slot} no longer holds ({layer}, {expert})"

    @invariant()
    def budget_and_slots_add_up(self):
        m = self.manager
        if m is None:
            return
        assert m.budget.used_bytes <= m.budget.total_bytes
        for name, pool in m.pools.items():
            resident = sum(1 for row in m.handles for h in row if name in h.versions)
            assert resident + pool.pending + pool.free_slots == pool.num_slots

    def teardown(self):
        if self.manager is not None:
            while self.in_flight:
                self._complete_oldest()
            self.manager.close()


DeviceTableMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_no_step_reads_a_partial_or_reused_slot = DeviceTableMachine.TestCase


def test_a_parked_version_predicted_within_the_step_is_back_in_the_table_at_once():
    """The in-step reserve takes a resident version out of the step's table (its slot may go to an
    in-step prefetch); when a policy predicts that very expert within the step, its entry points at
    the version again at once, not only from the next step on (before: 3,670 of 55,907 uses of a
    trace replay ran from host memory with their hi version resident)."""
    m = make_manager("hi-cache", 6, 0, on_miss="zero-copy", bandwidth=None)
    try:
        m.in_step_fed = True
        resident = [(layer, e) for layer in range(LAYERS) for e in range(2)]  # fills the 6 slots
        for layer in range(LAYERS):
            m.prefetch(layer, [0, 1], iteration=1)
        m.begin_step(1)
        m.end_step()
        for layer, e in resident:
            m.handles[layer][e].versions["hi"].ready.synchronize()
        for _ in range(20):  # the last steps' in-step prefetches wanted slots: park a reserve
            m.reserve.wanted("hi")
        m.begin_step(2)
        parked = list(m.reserve.parked["hi"])
        assert parked, "nothing parked"
        hi, host = m.pool_ids["hi"], m.pool_ids["host"]
        layer, expert = parked[0]
        assert m.table.device_table[layer, 0, expert] == host  # out of this step's table
        m.prefetch(layer, [expert], iteration=2)
        m.in_step(2, -1)
        slot = m.handles[layer][expert].versions["hi"].slot
        table = m.table.device_table
        entry = (int(table[layer, 0, expert]), int(table[layer, 1 + hi, expert]))
        assert entry == (hi, slot)
        assert m.metrics.unparked == 1 and (layer, expert) not in m.reserve.parked["hi"]
        gate_up, _ = m.kernel_pools(torch.float32)[hi].weights(slot, torch.float32)
        assert torch.equal(gate_up, expected_weights(layer, expert, "hi"))
        m.end_step()
    finally:
        m.close()


def test_a_copy_started_within_the_step_is_waited_for_by_its_layer():
    """wait_for_copies: an in-step prefetch for a later layer points that layer's entry at the copy at
    once, with the copy's number; the layer's read waits for the landed word and finds the expert's
    weights, not the poisoned slot; the step's record counts it as a hit on a copy in flight."""
    m = make_manager("hi-cache", 4, 0, on_miss="zero-copy", bandwidth=2e6, wait_for_copies=True)
    try:
        m.in_step_fed = True
        m.begin_step(1)
        hi = m.pool_ids["hi"]
        m.prefetch(2, [5], iteration=1)
        assert m.in_step(1, 0) == 1
        version = m.handles[2][5].versions["hi"]
        table = m.table.device_table
        assert (int(table[2, 0, 5]), int(table[2, 1 + hi, 5]), int(table[2, m.table.wait_row, 5])) == (
            hi, version.slot, version.gen)  # fmt: skip
        assert not version.ready.query()  # 2 MB/s: still in flight
        wait_for_landing(m.table.landed, version.slot, version.gen)
        gate_up, _ = m.kernel_pools(torch.float32)[hi].weights(version.slot, torch.float32)
        assert torch.equal(gate_up, expected_weights(2, 5, "hi"))
        m.end_step()
        ran = np.full((LAYERS, EXPERTS), UNUSED, dtype=np.int32)
        ran[2, 5] = hi + WAITED
        m.observe_step(ran, 1)
        assert m.metrics.hits_in_flight == 1 and m.metrics.layers[2].hits == 1
    finally:
        m.close()


def _entry(table, layer, expert):
    """What a reader of the device table sees for `(layer, expert)`: `(pool id, its slot there)`."""
    t = table.device_table
    pool = int(t[layer, 0, expert])
    return pool, int(t[layer, 1 + pool, expert]) if pool >= 0 else None


@settings(max_examples=50, deadline=None)
@given(old_pool=st.integers(-1, 2), new_pool=st.integers(0, 2), old_slot=st.integers(0, 9),
       new_slot=st.integers(0, 9), stale=st.integers(0, 9), wait=st.sampled_from([None, 3]))  # fmt: skip
def test_publish_words_never_show_a_reader_a_torn_entry(old_pool, new_pool, old_slot, new_slot, stale, wait):
    """A reader may look at the table between any two of a publication's word writes: it must see
    the old entry or the new one, never the new pool word with a slot that is not the new one (the
    slot word lands first, then the wait word, then the pool word)."""
    table = DeviceTable(2, 3, 4, torch.device("cpu"), landed_slots=1)
    if old_pool >= 0:
        table.set_entry(1, 2, old_pool, old_slot)
    table.master[1, 1 + new_pool, 2] = stale if new_pool != old_pool else old_slot
    table.write()
    old = _entry(table, 1, 2)
    words = table.publish_words(1, 2, new_pool, new_slot, wait)
    assert words[-1][0].data_ptr() == table.device_table[1, 0, 2:3].data_ptr()  # the pool word last
    for device_word, value in words:
        device_word.copy_(value)
        assert _entry(table, 1, 2) in (old, (new_pool, new_slot))
    assert _entry(table, 1, 2) == (new_pool, new_slot)
    if wait is not None:
        assert int(table.device_table[1, table.wait_row, 2]) == wait


def test_a_copy_publishes_its_entry_only_after_its_data_has_landed():
    """The copy's words ride on its own stream after the data: while the copy is under way the
    device table still sends the expert where it was (here: host memory)."""
    m = make_manager("hi-cache", 4, 0, bandwidth=1e5)  # ~0.1 s for one expert
    try:
        host, hi = m.pool_ids["host"], m.pool_ids["hi"]
        m.begin_step(1)
        m.end_step()
        assert int(m.table.device_table[1, 0, 3]) == host
        m.prefetch(1, [3], iteration=1)
        m.begin_step(2)
        version = m.handles[1][3].versions["hi"]
        assert not version.ready.query()
        assert int(m.table.device_table[1, 0, 3]) == host  # not yet: the data is still on its way
        version.ready.synchronize()
        assert (int(m.table.device_table[1, 0, 3]), int(m.table.device_table[1, 1 + hi, 3])) == (
            hi,
            version.slot,
        )
        m.end_step()
    finally:
        m.close()


class _WatchedWord:
    """A device-table word whose write is followed by a look at the whole table, as a reader
    between two of a publication's writes would take it."""

    def __init__(self, word: torch.Tensor, after_write):
        self.word, self.after_write = word, after_write

    def copy_(self, value, non_blocking: bool = False):
        self.word.copy_(value)
        self.after_write()


class _Gate:
    """A word write that holds the copy worker until `opened` is set."""

    def __init__(self, opened: threading.Event):
        self.opened = opened

    def copy_(self, value, non_blocking: bool = False):
        self.opened.wait()


class WatchedTransfer(CpuTransfer):
    """CPU copies whose publishing words each call `after_write` once written (in the order the
    transfer writes them). No copy starts before `opened` is set."""

    def __init__(self, after_write, **kw):
        super().__init__(**kw)
        self.after_write = after_write
        self.opened = threading.Event()
        super().copy(torch.zeros(1), torch.zeros(1), -1, then=[(_Gate(self.opened), None)])

    def _watch(self, words) -> list:
        return [(_WatchedWord(word, self.after_write), value) for word, value in words]

    def copy(self, dst, src, priority, then=()):
        return super().copy(dst, src, priority, then=self._watch(then))

    def write_words(self, words) -> None:
        super().write_words(self._watch(words))


def test_a_reader_between_a_publications_writes_never_sees_a_pool_word_before_its_slot_word():
    """Copies publish themselves through the real path (`prefetch` -> the copy's words on the copy
    side, in the transfer's order). After each word lands, every entry of the table must send its
    expert to a slot that holds that expert's version: a pool word written before its slot word
    would point at the slot word's previous value, which holds another expert or poison. The copies
    start within a step (the layer feed's `in_step`), after its whole-table write, so only their own
    words change the table."""
    m = make_manager("hi-cache", 4, 0, bandwidth=None)
    torn: list[str] = []
    seen = [0]

    def check_every_entry() -> None:
        seen[0] += 1
        for layer in range(LAYERS):
            for expert in range(EXPERTS):
                try:
                    read_entry(m, layer, expert)
                except AssertionError as e:
                    torn.append(f"after write {seen[0]}: ({layer}, {expert}): {e}")

    try:
        m.transfer.close()
        m.transfer = WatchedTransfer(check_every_entry, poison=True)
        m.begin_step(1)
        m.end_step()
        m.begin_step(2)  # the whole table is written now: from here only the copies' words change it
        m.prefetch(1, [3, 0, 2, 1], iteration=2)  # four experts, four slots: slot words differ
        assert m.in_step(2, 0) == 4  # layer 0 has routed: the copies for layer 1 start within the step
        m.transfer.opened.set()
        for expert in (3, 0, 2, 1):
            m.handles[1][expert].versions["hi"].ready.synchronize()
        m.end_step()
        assert seen[0] >= 8  # a slot word and a pool word per copy, each followed by a look
        assert not torn, torn[:3]
        assert {read_entry(m, 1, e) for e in range(4)} == {m.pool_ids["hi"]}
    finally:
        m.close()


def test_the_in_step_reserve_parks_no_version_of_the_hot_set():
    """lo+hi (combined): the reserve for in-step predictions takes only versions DynaExq does not
    want in hi; its hot set keeps its entries, whatever the in-step prefetches wanted."""
    m = make_manager("lo+hi", 3, LAYERS * EXPERTS, on_miss="lo", bandwidth=None)
    try:
        m.in_step_fed = True
        hot = [(0, 0), (1, 1), (2, 2)]  # fills the 3 hi slots
        for layer, e in hot:
            m.set_precision(layer, e, "hi")
        m.begin_step(1)
        m.end_step()
        for layer, e in hot:
            m.handles[layer][e].versions["hi"].ready.synchronize()
        for _ in range(20):  # the last steps' in-step prefetches wanted slots
            m.reserve.wanted("hi")
        m.begin_step(2)
        hi = m.pool_ids["hi"]
        assert not m.reserve.parked["hi"]
        assert all(m.table.device_table[layer, 0, e] == hi for layer, e in hot)
        m.end_step()
    finally:
        m.close()
