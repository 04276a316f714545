"""A hypothesis state machine over the KV block allocator, the prefix cache and the scheduler
(engine/kv_blocks.py, engine/scheduler.py), with real `Sequence`s.

Rules: add a request, run a step (admissions with prefix hits, chunked prefill, decodes, the
preemptions a full pool forces, evictions of cached blocks), finish a running sequence, preempt
one. The pool itself is modelled slot by slot: computing token `p` of a sequence writes, into the
slot its block table gives, the whole token prefix `tokens[:p + 1]` whose KV that slot now holds.

Invariants, after every rule:
- each block's reference count equals the number of running sequences whose table holds it;
- no block of a running sequence is free or cached (it cannot be handed out again);
- every token a running sequence counts as computed (a prefix hit's included) lies in a slot that
  holds the KV of that sequence's own whole token prefix.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moetide.engine.kv_blocks import BlockAllocator
from moetide.engine.sampling import SamplingParams
from moetide.engine.scheduler import Scheduler
from moetide.engine.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 2
NUM_BLOCKS = 7
ALPHABET = st.integers(1, 3)  # few token ids: prompts share prefixes and whole blocks often


class KVBlocksMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockAllocator(NUM_BLOCKS, block_size=BLOCK_SIZE)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=3, prefill_chunk_tokens=5)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix it holds

    # -- the model of the pool -------------------------------------------------------------------------
    def _compute(self, seq: Sequence, n: int) -> None:
        """Write the KV of `seq`'s next `n` tokens, then tell the scheduler they are computed."""
        tokens = seq.token_ids()
        for p in range(seq.num_computed, seq.num_computed + n):
            block = seq.block_table[p // BLOCK_SIZE]
            assert block != 0, "a token was written into the pad block"
            self.kv[(block, p % BLOCK_SIZE)] = tuple(tokens[: p + 1])
        self.scheduler.computed(seq, n)

    def _sample(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        if len(seq.output_ids) >= seq.params.max_tokens:
            seq.finish("length")

    # -- rules -----------------------------------------------------------------------------------------
    @rule(
        prompt=st.lists(ALPHABET, min_size=1, max_size=7),
        max_tokens=st.integers(1, 4),
    )
    def add_request(self, prompt: list[int], max_tokens: int) -> None:
        # LLMEngine.add_request refuses a request that cannot fit the pool alone
        if self.blocks.blocks_for(len(prompt) + max_tokens) > NUM_BLOCKS:
            return
        self.scheduler.waiting.append(Sequence(prompt, SamplingParams(max_tokens=max_tokens)))

    @rule(tokens=st.lists(ALPHABET, min_size=8, max_size=8))
    def step(self, tokens: list[int]) -> None:
        waiting_before = set(map(id, self.scheduler.waiting))
        step = self.scheduler.schedule()
        for seq in self.scheduler.running:
            if id(seq) in waiting_before:  # admitted now: its prefix hit must hold its own prefix
                self._check_computed_kv(seq)
        for seq in step.decode:
            self._compute(seq, 1)
        for seq, n in step.prefill:
            self._compute(seq, n)
        for i, seq in enumerate([*step.decode, *(s for s, _ in step.prefill)]):
            if seq.pending_tokens == 0 and not seq.finished:
                self._sample(seq, tokens[i % len(tokens)])
        self.scheduler.drop_finished()

    @precondition(lambda self: self.scheduler.running)
    @rule(pick=st.integers(0, 10))
    def finish(self, pick: int) -> None:
        seq = self.scheduler.running[pick % len(self.scheduler.running)]
        seq.finish("stop")
        self.scheduler.drop_finished()

    @precondition(lambda self: self.scheduler.running)
    @rule(pick=st.integers(0, 10))
    def preempt(self, pick: int) -> None:
        seq = self.scheduler.running[pick % len(self.scheduler.running)]
        self.scheduler.preempt(seq)
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []

    # -- invariants ------------------------------------------------------------------------------------
    def _check_computed_kv(self, seq: Sequence) -> None:
        tokens = seq.token_ids()
        for p in range(seq.num_computed):
            slot = (seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)
            assert self.kv.get(slot) == tuple(tokens[: p + 1]), (
                f"token {p} of {tokens} reads KV computed for {self.kv.get(slot)}"
            )

    @invariant()
    def reference_counts_equal_live_owners(self) -> None:
        owners = Counter(b for seq in self.scheduler.running for b in seq.block_table)
        for block in range(1, NUM_BLOCKS + 1):
            assert self.blocks.ref_count(block) == owners[block], f"block {block}"
        assert self.blocks.num_used == len(owners)

    @invariant()
    def no_owned_block_can_be_handed_out(self) -> None:
        owned = {b for seq in self.scheduler.running for b in seq.block_table}
        assert not owned & self.blocks.available_blocks()
        assert 0 not in owned

    @invariant()
    def running_sequences_read_their_own_prefix(self) -> None:
        for seq in self.scheduler.running:
            self._check_computed_kv(seq)


KVBlocksMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_blocks_state_machine = KVBlocksMachine.TestCase


def test_a_block_after_a_different_prefix_is_not_a_hit():
    """[1,2,7,8] shares block [7,8] with [5,6,7,8], but that block's KV was computed after [5,6]."""
    blocks = BlockAllocator(8, block_size=2)
    for prompt in ([1, 2, 3, 4, 0], [5, 6, 7, 8, 0]):
        table, _ = blocks.allocate(prompt)
        blocks.commit(table, prompt, num_computed=len(prompt), hashed=0)
        blocks.free(table)
    table, cached = blocks.allocate([1, 2, 7, 8, 0])
    assert cached == 2  # [1,2] only


def test_a_shared_block_counts_each_owner():
    blocks = BlockAllocator(4, block_size=2)
    first, _ = blocks.allocate([1, 2, 3])
    blocks.commit(first, [1, 2, 3], num_computed=3, hashed=0)
    second, cached = blocks.allocate([1, 2, 4])
    assert cached == 2 and second[0] == first[0]
    assert blocks.ref_count(first[0]) == 2
    blocks.free(first)
    assert blocks.ref_count(second[0]) == 1 and second[0] not in blocks.available_blocks()
