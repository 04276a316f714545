"""A request in flight: its tokens, sampling state, stop detection and timings."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds KV blocks: prefilling (chunk by chunk) or decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    """One prompt being completed. Timestamps are `time.perf_counter()` seconds."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why it failed, with finish_reason "error"
    text: str = ""  # decoded output, cut at a stop string
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    # the key of this sequence's draws (engine/sampling.py): its seed, or one from torch's generator
    sample_seed: int = 0
    # the paged KV cache (engine/kv_blocks.py): the blocks holding this sequence's tokens in
    # order, how many tokens' KV they hold, how many of them are full and hashed for the prefix
    # cache; all reset when the sequence is preempted (its KV is recomputed on re-admission)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    hashed_blocks: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    preemptions: int = 0
    # decode ahead (LLMEngine): 1 while the token the last step sampled is still on the device only;
    # it counts in `num_tokens` (the next step's input, at its position) but not in `output_ids`
    ahead: int = 0

    def __post_init__(self) -> None:
        seed = self.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        self.sample_seed = seed & (2**63 - 1)

    def sample_key(self) -> tuple[int, int]:
        """`(seed, draw)` of the token sampled now: the draw is its position, so each draw is new and a
        seeded request gives the same tokens whatever else is batched with it."""
        return self.sample_seed, self.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.ahead

    @property
    def pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet: 1 while decoding, more while prefilling."""
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Prompt + output token ids `[start, end)`, of the tokens the host has read (not one sampled
        ahead on the device)."""
        known = len(self.prompt_ids) + len(self.output_ids)
        end = known if end is None else end
        if end > known:
            raise RuntimeError(f"token ids up to {end} asked of a sequence whose host holds {known}")
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - prompt, 0) : end - prompt]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time between output tokens after the first."""
        if len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (len(self.token_times_s) - 1)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_s = time.perf_counter()
