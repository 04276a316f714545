"""KV blocks on the host: which pool blocks hold each sequence's tokens, and the prefix cache.

The device pool (engine/paged_cache.py) has `num_blocks + 1` blocks of `block_size` token slots
per layer. Block 0 is the pad block: unused block-table entries point at it (its columns are
always masked); it is never handed out. A sequence's block table lists its blocks in token order:
token `p` lives in slot `table[p // block_size] * block_size + p % block_size`.

A block is in one of three states:

- in use: referenced by at least one sequence (`ref_count > 0`); a full block's tokens may be
  shared by several sequences with the same prefix;
- cached: no reference, but full and hashed: it still holds the KV of a known prefix and is handed
  out again to a request with that prefix, until it is evicted (least recently freed first);
- free: no reference, no reusable content.

The hash of block i chains the hash of block i-1 with block i's token ids, so equal hashes mean
equal prefixes (the token ids are compared too, so a hash collision is a miss, never wrong KV).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ..residency import KV_BLOCK_SIZE as BLOCK_SIZE  # tokens per KV block (the memory plan sizes the pool)


@dataclass
class _Block:
    ref_count: int = 0
    hash: int | None = None  # chain hash of the prefix up to and including this block, once full
    tokens: tuple[int, ...] | None = None  # this block's token ids, when hashed


class BlockAllocator:
    """Blocks 1..num_blocks: reference counts, free list, prefix cache with LRU eviction.

    Args:
        num_blocks: usable blocks (the pad block comes on top).
        block_size: tokens per block.
        prefix_caching: reuse cached blocks of a request's longest matching prefix.
    """

    def __init__(self, num_blocks: int, *, block_size: int = BLOCK_SIZE, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks + 1)]  # index 0: the pad block
        self._free: deque[int] = deque(range(1, num_blocks + 1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, LRU first
        self._by_hash: dict[int, int] = {}
        self.high_water = 0  # the highest block id ever handed out (the pool grows to it on the CPU)
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of them, found cached
        self.evictions = 0

    # -- counts ---------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones and cached ones (evicted on the way)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks referenced by a sequence."""
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        """Sequences holding `block` in their table."""
        return self._blocks[block].ref_count

    def available_blocks(self) -> set[int]:
        """Blocks that the next allocation may hand out: free ones and unreferenced cached ones."""
        return set(self._free) | set(self._cached)

    # -- allocation ------------------------------------------------------------------------------------
    def _chunk(self, token_ids: list[int], i: int) -> tuple[int, ...]:
        return tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` in full blocks, leaving at least
        one token to compute (its logits give the next token)."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        prev = None
        for i in range((len(token_ids) - 1) // self.block_size):
            chunk = self._chunk(token_ids, i)
            h = hash((prev, chunk))
            block = self._by_hash.get(h)
            if block is None or self._blocks[block].tokens != chunk:
                break
            hits.append(block)
            prev = h
        return hits

    def allocate(self, token_ids: list[int], *, reserve: int = 0) -> tuple[list[int], int] | None:
        """Blocks for all of `token_ids`: the cached prefix's, then new ones. Returns the block
        table and the number of tokens whose KV is already there, or None when fewer than
        `reserve` blocks would be left (nothing is taken then)."""
        hits = self.match_prefix(token_ids)
        need = self.blocks_for(len(token_ids)) - len(hits)
        cached_hits = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        if need + reserve > self.num_available - cached_hits:
            return None
        if self.prefix_caching:
            self.query_tokens += len(token_ids)
            self.hit_tokens += len(hits) * self.block_size
        for b in hits:
            if self._blocks[b].ref_count == 0:
                del self._cached[b]
            self._blocks[b].ref_count += 1
        return hits + [self._take() for _ in range(need)], len(hits) * self.block_size

    def append_slot(self, table: list[int], num_tokens: int) -> bool:
        """Grow `table` (in place) to hold `num_tokens` tokens; False when no block is left."""
        while len(table) < self.blocks_for(num_tokens):
            if not self.num_available:
                return False
            table.append(self._take())
        return True

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._cached.popitem(last=False)
            meta = self._blocks[block]
            if self._by_hash.get(meta.hash) == block:
                del self._by_hash[meta.hash]
            meta.hash = meta.tokens = None
            self.evictions += 1
        self._blocks[block].ref_count = 1
        self.high_water = max(self.high_water, block)
        return block

    def commit(self, table: list[int], token_ids: list[int], num_computed: int, hashed: int) -> int:
        """Hash the blocks of `table` that became full with computed KV (blocks `hashed` ..
        `num_computed // block_size - 1`) so later requests can reuse them; returns the new count
        of hashed blocks. A block equal to one already cached stays private (freed, not cached)."""
        if not self.prefix_caching:
            return hashed
        full = min(num_computed // self.block_size, len(table))
        prev = self._blocks[table[hashed - 1]].hash if hashed else None
        for i in range(hashed, full):
            meta = self._blocks[table[i]]
            if meta.hash is None:
                chunk = self._chunk(token_ids, i)
                meta.hash, meta.tokens = hash((prev, chunk)), chunk
                self._by_hash.setdefault(meta.hash, table[i])
            prev = meta.hash
        return max(hashed, full)

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block of `table`. Unreferenced hashed blocks stay cached; the
        table's tail is freed first, so it is evicted before the prefix that others may share."""
        for block in reversed(table):
            meta = self._blocks[block]
            meta.ref_count -= 1
            if meta.ref_count > 0:
                continue
            if meta.hash is not None and self._by_hash.get(meta.hash) == block:
                self._cached[block] = None
            else:
                meta.hash = meta.tokens = None
                self._free.append(block)
        table.clear()

    def reset_counters(self) -> None:
        """Zero the prefix-cache counters (after a warm-up: what `/metrics` counts starts with the
        first client)."""
        self.query_tokens = self.hit_tokens = self.evictions = 0

    def stats(self) -> dict[str, int]:
        """Counters for metrics: blocks used/total, prefix-cache tokens queried and hit."""
        return {
            "kv_blocks_used": self.num_used,
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_cached": self.num_cached,
            "prefix_cache_queries": self.query_tokens,
            "prefix_cache_hits": self.hit_tokens,
            "prefix_cache_evictions": self.evictions,
        }
