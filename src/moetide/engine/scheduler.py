"""Which sequences run in the next step, and in which KV blocks.

Each step:

1. **Decode** every running sequence that has one uncomputed token (its last sampled token),
   oldest first, giving it a new block when that token starts one. When no block is left the
   youngest running sequence is preempted (vLLM's recompute preemption): its blocks are freed
   (full ones stay in the prefix cache), it goes back to the front of the queue with its output so
   far, and on re-admission its prompt + output are prefilled again before it samples on. Greedy
   and seeded outputs are unchanged (its sampler state is its own).
2. **Prefill** up to `prefill_chunk_tokens` tokens in one packed forward: first the next chunks of
   sequences already prefilling, then new sequences from the queue (FIFO), each admitted when a
   batch row and the blocks of all its tokens (less its cached prefix) are free, leaving one
   block per running sequence for their decodes. A long prompt is prefilled over several steps,
   interleaved with the running decodes.

A sequence alone always fits: `LLMEngine.add_request` refuses one whose prompt + max_tokens needs
more blocks than the pool holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_blocks import BlockAllocator
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """What one step runs: sequences decoding one token, and prefill chunks `(seq, tokens)`."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """The queue, the running sequences and their blocks.

    Args:
        blocks: the block allocator of the KV pool.
        max_num_seqs: running sequences at most.
        prefill_chunk_tokens: prompt tokens prefilled per step at most (one packed forward).
    """

    def __init__(self, blocks: BlockAllocator, *, max_num_seqs: int, prefill_chunk_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the youngest last
        self.preemptions = 0

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.pending_tokens != 1:
                continue
            while not self.blocks.append_slot(seq.block_table, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                step.preempted.append(victim)
                if victim is seq:
                    break
            else:
                step.decode.append(seq)
        budget = self.prefill_chunk_tokens
        for seq in self.running:
            if budget and seq.pending_tokens > 1:
                n = min(seq.pending_tokens, budget)
                step.prefill.append((seq, n))
                budget -= n
        while budget and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            got = self.blocks.allocate(seq.token_ids(), reserve=len(self.running))
            if got is None:
                break
            self.waiting.popleft()
            seq.block_table, seq.cached_tokens = got
            seq.num_computed = seq.cached_tokens
            seq.hashed_blocks = seq.cached_tokens // self.blocks.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.pending_tokens, budget)
            step.prefill.append((seq, n))
            budget -= n
        return step

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first again; its KV is recomputed when it runs again."""
        self.running.remove(seq)
        self.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def computed(self, seq: Sequence, tokens: int) -> None:
        """`tokens` more of `seq`'s tokens have their KV in the pool: hash the blocks they filled."""
        seq.num_computed += tokens
        full = seq.num_computed // self.blocks.block_size
        if self.blocks.prefix_caching and full > seq.hashed_blocks:
            ids = seq.token_ids(0, full * self.blocks.block_size)
            seq.hashed_blocks = self.blocks.commit(seq.block_table, ids, seq.num_computed, seq.hashed_blocks)

    def release(self, seq: Sequence) -> None:
        """Give `seq`'s blocks back (a finished or failed sequence, or a preempted one)."""
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.hashed_blocks = 0

    def drop_finished(self) -> None:
        """Finished sequences leave the running list and give their blocks back."""
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self.release(seq)

    def decode_blocks_needed(self) -> int:
        """New blocks the running sequences' next decode takes: one for each whose next token starts one."""
        return sum(max(0, self.blocks.blocks_for(s.num_tokens) - len(s.block_table)) for s in self.running)

    def used_block_bound(self) -> int:
        """Σ ceil(tokens / block_size) + 1 over running sequences: what the pool may hold in use."""
        return sum(self.blocks.blocks_for(s.num_tokens) + 1 for s in self.running)
