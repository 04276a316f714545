"""The engine loop: `schedule -> run -> postprocess`, one call to `step()` at a time.

Requests wait in a FIFO queue; the scheduler (engine/scheduler.py) admits them when a batch slot
and the KV blocks of their prompt are free (paged KV cache: engine/kv_blocks.py on the host,
engine/paged_cache.py on the device), prefills long prompts in chunks interleaved with the
running decodes, and preempts the youngest sequence when blocks run out. Each step runs at most
one decode forward (every decoding sequence) and one packed prefill forward.

Decode ahead (`decode_ahead`): in a step that only decodes, the sampled tokens stay on the device;
the next step is scheduled and launched with them as its input (`runner.DeviceTokens`), and only
then does the host read them (stop checks, text, outputs), while the device runs that next step.
A step reads its tokens before the next is scheduled whenever that next step could differ from a
plain decode of the same sequences: a prompt to prefill or admit, a sequence that ends on its
length, a KV pool short of a block per sequence, or a row that does not sample greedily.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..progress import on_terminal
from .detokenize import find_stop, stable_prefix
from .kv_blocks import BlockAllocator
from .runner import DeviceTokens, ModelRunner
from .sampling import SamplingParams, sample_next_tokens
from .scheduler import Scheduler
from .sequence import Sequence

PREFILL_CHUNK_TOKENS = 512  # prompt tokens prefilled per step at most


@dataclass
class _Ahead:
    """A decode step whose tokens the host has not read: `tokens (B,)` on the device, row i for
    `seqs[i]`, and their copy to host memory, complete once `event` is (None: CPU, done)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: torch.Tensor
    event: "torch.cuda.Event | None"

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> "_Ahead":
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(seqs, tokens, host, event)

    def read(self) -> torch.Tensor:
        """The tokens on the host (waits for their copy: the step that sampled them has finished)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass
class StepOutput:
    """What one step produced for one sequence: new token ids, whether it finished."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class LLMEngine:
    """Continuous batching over a `ModelRunner` and a paged KV cache.

    Args:
        runner: device work (it holds the paged KV cache's pools).
        tokenizer: for stop strings and output text.
        eos_token_ids: ids that end a sequence (unless `ignore_eos`).
        blocks: the KV pool's block allocator (its size comes from the memory plan).
        max_num_seqs: rows decoded together at most.
        max_model_len: prompt + output tokens at most per sequence.
        kv_cache_tokens: the KV reservation of the memory plan (tokens), for reports; None = none given.
        prefill_chunk_tokens: prompt tokens prefilled per step at most.
        decode_ahead: launch a decode step before reading the last one's tokens where that changes
            nothing but timing (module docstring).
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        eos_token_ids: set[int],
        blocks: BlockAllocator,
        *,
        max_num_seqs: int = 32,
        max_model_len: int = 2048,
        kv_cache_tokens: int | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        decode_ahead: bool = False,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        self.scheduler = Scheduler(
            blocks, max_num_seqs=max_num_seqs, prefill_chunk_tokens=prefill_chunk_tokens
        )
        self.decode_ahead = decode_ahead
        self._ahead: _Ahead | None = None
        self.ahead_steps = 0  # decode steps launched before the tokens of the step before were read
        self.steps = 0
        self.last_step: dict = {}  # the last step's shape: decode rows, prefill tokens, folded, queue

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds: what one sequence (prompt + output) may use at most."""
        return self.blocks.num_blocks * self.blocks.block_size

    def kv_stats(self) -> dict[str, int]:
        """KV blocks in use / in all, prefix-cache tokens queried / hit, preemptions."""
        return {**self.blocks.stats(), "preemptions": self.scheduler.preemptions}

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len} (prompt + output)"
            )
        need = min(self.max_model_len, len(prompt_ids) + params.max_tokens)
        if need > self.kv_capacity_tokens:
            what = "the prompt" if len(prompt_ids) >= self.kv_capacity_tokens else "prompt + max_tokens"
            raise ConfigError(
                f"{what} needs {self.blocks.blocks_for(need)} KV blocks of {self.blocks.block_size} tokens;"
                f" the KV pool holds {self.blocks.num_blocks} ({self.kv_capacity_tokens} tokens):"
                " lower max_tokens, shorten the prompt or give the KV cache more memory"
            )
        seq = Sequence(list(prompt_ids), params, **({"request_id": request_id} if request_id else {}))
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its KV blocks are freed at the next step."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish("abort")
                return True
        for seq in self.running:
            if seq.request_id == request_id and not seq.finished:
                seq.finish("abort")
                return True
        return False

    def fail_running(self, reason: str = "error") -> list[Sequence]:
        """Finish every running sequence and free its blocks; waiting requests stay queued.

        Recovery after `step()` raised: the running sequences' KV may be half-written, so none can
        be trusted (blocks hashed before the failed step hold complete KV and stay cached).
        """
        self._drop_ahead()  # tokens of a step that may not have finished cleanly: never read
        failed = [s for s in self.running if not s.finished]
        for seq in failed:
            seq.finish(reason)
        self.scheduler.drop_finished()
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._ahead is not None)

    def warm_up(self, progress: bool = True) -> int:
        """Before serving, on CUDA: run every shape a client's request can meet once, so that each
        decode graph is captured and each Triton kernel is compiled before anyone waits for it.

        - Decode once at every row bucket of the CUDA-graph decoder (up to `max_num_seqs`): a batch of
          that many 4-token requests asking 2 tokens.
        - Prefill once at every tile bucket of the fused MoE kernel that a packed prefill row can
          reach (`t_bucket` of more tokens than ride in a decode step, up to the step's prefill
          budget): one request of that many prompt tokens. A prefill of a new bucket compiles the
          kernel's gate_up and down for every pool (about a second each): without
          this, a wave's clients all waited ~2.3 s once at 64 clients (TTFT p90 2.40 s, 1.00 s with
          it) and a 2k-token prompt's first token took 3.1 s (0.41 s with it).

        Their routing reaches the policies as any request's does. Returns the steps run (0: no graph
        decoder and not CUDA, nothing to warm)."""
        from ..compute.fused_moe_config import t_bucket
        from .graphed_decode import row_bucket

        if self.has_unfinished():
            return 0
        graphs = self.runner.graphs
        batches: list[tuple[int, int]] = []  # (requests, prompt tokens each)
        if graphs is not None:
            sizes = range(1, self.max_num_seqs + 1)
            buckets = sorted({row_bucket(rows, graphs.max_rows, graphs.row_buckets) for rows in sizes})
            batches += [(rows, 4) for rows in buckets]
        if self.runner.device.type == "cuda":  # the fused MoE kernel (Triton) runs on CUDA only
            budget = min(self.scheduler.prefill_chunk_tokens, self.max_model_len - 2)
            lengths = {t_bucket(n) for n in range(self.runner.fold_prefill_tokens + 1, budget + 1)}
            batches += [(1, min(n, budget)) for n in sorted(lengths)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        steps = 0
        redraw = progress and on_terminal()  # a log gets the one line at the end, not every redraw
        for i, (rows, prompt_len) in enumerate(batches):
            if redraw:
                what = f"batch {rows}" if prompt_len == 4 else f"prefill {prompt_len}"
                print(f"\r[moetide] warming up: {what} ({i + 1}/{len(batches)})   ", end="", file=sys.stderr,
                      flush=True)  # fmt: skip
            for r in range(rows):
                self.add_request([3 + (r + 7 * i + j) % 97 for j in range(prompt_len)], params)
            while self.has_unfinished():
                self.step()
                steps += 1
        self.blocks.reset_counters()  # the warm-up's prompts are nobody's: the prefix counters start now
        if progress:
            captured = f", {graphs.captures} graphs" if graphs is not None else ""
            line = f"[moetide] warmed up: {len(batches)} shapes{captured}"
            print(f"\r{line}          " if redraw else line, file=sys.stderr, flush=True)
        return steps

    # -- postprocess ---------------------------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Record a token; return True if the sequence is finished."""
        seq.output_ids.append(token)
        seq.token_times_s.append(now)
        if seq.first_token_s is None:
            seq.first_token_s = now
        p = seq.params
        if not p.ignore_eos and (token in self.eos_token_ids or token in p.stop_token_ids):
            seq.output_ids.pop()  # the end-of-turn token is not part of the text
            seq.text = self._decode(seq.output_ids)
            seq.finish("stop")
            return True
        previous, seq.text = seq.text, self._decode(seq.output_ids)
        if p.stop:
            cut = find_stop(seq.text, previous, p.stop)  # only the new tail: bounded work per token
            if cut >= 0:
                seq.text = seq.text[:cut]
                seq.finish("stop")
                return True
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.text = stable_prefix(seq.text)  # a character the token budget cut half-way is not shown
            seq.finish("length")
            return True
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """schedule -> run -> postprocess. Returns the tokens each sequence gained this step.

        The decoding sequences decode one token; then the scheduled prefill chunks run in one
        forward, and each sequence whose prompt (or, after a preemption, prompt + output) is then
        complete samples its next token from it. With decode ahead, a step that only decodes
        returns the tokens of the step before it (module docstring).
        """
        self.steps += 1
        outputs: list[StepOutput] = []
        self.scheduler.drop_finished()
        if self._ahead is not None and not self._can_chain():
            outputs += self._read_ahead()
            self.scheduler.drop_finished()
        scheduled = self.scheduler.schedule()
        self.runner.kv.reserve(self.blocks.high_water)
        # short prefill chunks ride in the decode step where the graphed decoder takes the rows
        fold = bool(scheduled.prefill) and self.runner.folds(scheduled.decode, scheduled.prefill)
        self.last_step = {"decode": len(scheduled.decode), "prefill": sum(n for _, n in scheduled.prefill),
                          "fold": fold, "running": len(self.running),
                          "waiting": len(self.waiting)}  # fmt: skip
        if scheduled.decode and not scheduled.prefill and self._may_go_ahead(scheduled.decode):
            outputs += self._decode_ahead(scheduled.decode)
        else:
            outputs += self._run(scheduled, fold)
        self.scheduler.drop_finished()  # their blocks are free for the next step's admissions
        if not self.has_unfinished():  # idle: the last steps' observations reach metrics and policies
            self.runner.flush()
        return outputs

    def _run(self, scheduled, fold: bool) -> list[StepOutput]:
        """The scheduled decode (with `fold`, the prefill chunks as rows of it) and prefill forwards,
        each step's tokens read before the next is scheduled."""
        if self._ahead is not None:  # _can_chain let only a step that goes ahead again through
            raise RuntimeError("a step was scheduled over tokens sampled ahead that it cannot take")
        outputs: list[StepOutput] = []
        if scheduled.decode or fold:
            chunks = scheduled.prefill if fold else []
            logits = self.runner.decode(scheduled.decode, chunks)
            for seq in scheduled.decode:
                self.scheduler.computed(seq, 1)
            seqs, rows = list(scheduled.decode), logits[: len(scheduled.decode)]
            if chunks:
                ready, ready_rows = self._chunks_computed(chunks, logits[len(scheduled.decode) :])
                seqs, rows = seqs + ready, torch.cat([rows, ready_rows])
            if seqs:
                outputs += self._postprocess(seqs, self._sample(seqs, rows))
        if scheduled.prefill and not fold:
            ready, rows = self._chunks_computed(scheduled.prefill, self.runner.prefill(scheduled.prefill))
            if ready:
                outputs += self._postprocess(ready, self._sample(ready, rows))
        return outputs

    # -- decode ahead ----------------------------------------------------------------------------------
    def _may_go_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether this decode step's tokens may stay on the device: every row samples greedily there."""
        return self.decode_ahead and all(s.params.greedy for s in seqs)

    def _can_chain(self) -> bool:
        """Whether the next step may be scheduled before the tokens sampled ahead are read: it is then
        a plain decode of the same sequences (no prompt to prefill or admit, no sequence ending on
        its length, a free block for every sequence whose next token starts one: no preemption)."""
        sched = self.scheduler
        live = [s for s in self._ahead.seqs if not s.finished]
        if not live or (sched.waiting and len(sched.running) < sched.max_num_seqs):
            return False
        if any(s.pending_tokens > 1 for s in sched.running) or not self._may_go_ahead(sched.running):
            return False
        if self.blocks.num_available < sched.decode_blocks_needed():
            return False
        return not any(
            len(s.output_ids) + s.ahead >= s.params.max_tokens or s.num_tokens >= self.max_model_len
            for s in live
        )

    def _decode_ahead(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Decode `seqs`, keep the sampled tokens on the device, then read the step before's (while
        this one runs); returns that step's outputs. The rows of sequences the step before finished
        were run for nothing; their tokens are dropped when read."""
        ahead = self._ahead
        feed = None
        if ahead is not None:
            index = {id(s): i for i, s in enumerate(ahead.seqs)}
            rows = [r for r, s in enumerate(seqs) if s.ahead]
            feed = DeviceTokens(ahead.tokens, rows, [index[id(seqs[r])] for r in rows])
            self.ahead_steps += 1
        logits = self.runner.decode(seqs, device_tokens=feed)
        tokens = self._sample(seqs, logits)
        nxt = _Ahead.start(list(seqs), tokens)
        outputs = self._read_ahead()  # the blocks its tokens fill are hashed below, with their ids
        live = [s for s in seqs if not s.finished]
        for seq in live:
            self.scheduler.computed(seq, 1)
            seq.ahead = 1
        self._ahead = nxt if live else None  # rows of finished sequences only: nothing to read
        return outputs

    def _read_ahead(self) -> list[StepOutput]:
        """Read the tokens sampled ahead (waits for the step that sampled them) and postprocess them."""
        ahead = self._drop_ahead()
        return self._postprocess(ahead.seqs, ahead.read()) if ahead is not None else []

    def _drop_ahead(self) -> _Ahead | None:
        """Forget the tokens sampled ahead (their sequences hold no unread token any more); returns them."""
        ahead, self._ahead = self._ahead, None
        for seq in ahead.seqs if ahead is not None else ():
            seq.ahead = 0
        return ahead

    def _chunks_computed(
        self, chunks: list[tuple[Sequence, int]], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Account prefill `chunks` as computed; `logits (C, V)`, one per chunk's last token -> the
        sequences whose prompt (or, after a preemption, prompt + output) is now complete, and their
        rows: they sample their next token."""
        for seq, n in chunks:
            self.scheduler.computed(seq, n)
        ready = [i for i, (seq, _) in enumerate(chunks) if seq.pending_tokens == 0]
        rows = logits if len(ready) == len(chunks) else logits[ready]
        return [chunks[i][0] for i in ready], rows

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """`logits (B, V)` -> `(B,)` next tokens. A row whose sampling raises fails its sequence alone."""
        errors: list[tuple[int, Exception]] = []
        tokens = sample_next_tokens(logits, [s.params for s in seqs], [s.sample_key() for s in seqs], errors)
        for i, exc in errors:
            _fail(seqs[i], "sampling", exc)
        return tokens

    def _postprocess(self, seqs: list[Sequence], tokens: torch.Tensor) -> list[StepOutput]:
        now = time.perf_counter()
        out = []
        for seq, tok in zip(seqs, tokens.tolist(), strict=True):  # NOTE: host sync, once per forward
            if seq.finished:  # aborted or failed while in flight: its blocks are freed at the next step
                continue
            before = len(seq.output_ids)
            try:
                done = self._append_token(seq, tok, now)
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer: this sequence's own failure
                _fail(seq, "postprocessing", exc)
                done = True
            out.append(StepOutput(seq, seq.output_ids[before:], done))
        return out


def _fail(seq: Sequence, stage: str, exc: Exception) -> None:
    """End one sequence with finish_reason "error"; the others of the batch carry on."""
    seq.error = f"{stage} failed: {type(exc).__name__}: {exc}"
    seq.finish("error")
