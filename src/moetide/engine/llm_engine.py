"""The engine loop: `schedule -> run -> postprocess`, one call to `step()` at a time.

Requests wait in a FIFO queue and join the running batch between steps when a batch slot and
their KV-cache reservation (prompt + max_tokens tokens) fit; finished ones leave. Each step
prefills at most one admitted group of new sequences, then decodes every running sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .runner import BatchKVCache, ModelRunner
from .sampling import SamplingParams, sample_next_tokens
from .sequence import Sequence, SequenceStatus


@dataclass
class StepOutput:
    """What one step produced for one sequence: new token ids, whether it finished."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class LLMEngine:
    """Continuous batching over a `ModelRunner`.

    Args:
        runner: device work.
        tokenizer: for stop strings and output text.
        eos_token_ids: ids that end a sequence (unless `ignore_eos`).
        max_num_seqs: rows decoded together at most.
        max_model_len: prompt + output tokens at most per sequence.
        kv_cache_tokens: total tokens the KV reservation holds (rows are padded to a common length,
            so admission counts `rows * longest row`); None = no limit.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        eos_token_ids: set[int],
        *,
        max_num_seqs: int = 32,
        max_model_len: int = 2048,
        kv_cache_tokens: int | None = None,
        max_prefill_tokens: int = 4096,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.batch: BatchKVCache | None = None
        self._last_tokens: torch.Tensor | None = None  # (B,) on device
        self.steps = 0

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
        seq = Sequence(list(prompt_ids), params, **({"request_id": request_id} if request_id else {}))
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its KV rows are freed at the next step."""
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
        """Finish every running sequence and drop the batch; waiting requests stay queued.

        Recovery after `step()` raised: the batch's KV cache may be half-updated, so no running row
        can be trusted. Sequences admitted by the failed step are in neither list; the caller owns them.
        """
        failed = [s for s in self.running if not s.finished]
        for seq in failed:
            seq.finish(reason)
        self.running = []
        if self.batch is not None:
            self.batch.close()
        self.batch, self._last_tokens = None, None
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _budget_tokens(self, seq: Sequence) -> int:
        return min(self.max_model_len, len(seq.prompt_ids) + seq.params.max_tokens)

    # -- schedule ------------------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        prefill_tokens = 0
        rows = len(self.running)
        longest = max((self._budget_tokens(s) for s in self.running), default=0)
        while self.waiting and rows < self.max_num_seqs:
            seq = self.waiting[0]
            need = self._budget_tokens(seq)
            new_longest = max(longest, need)
            if self.kv_cache_tokens is not None and (rows + 1) * new_longest > self.kv_cache_tokens:
                if rows == 0:  # even alone it cannot fit: fail it rather than wait forever
                    self.waiting.popleft()
                    seq.finish("length")
                    continue
                break
            if admitted and prefill_tokens + len(seq.prompt_ids) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            admitted.append(seq)
            prefill_tokens += len(seq.prompt_ids)
            rows += 1
            longest = new_longest
        return admitted

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
        seq.text = self._decode(seq.output_ids)
        if p.stop:
            cut = min((i for i in (seq.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                seq.finish("stop")
                return True
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")
            return True
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """schedule -> run -> postprocess. Returns the tokens each sequence gained this step.

        Running rows decode one token; then newly admitted sequences are prefilled (their first
        token comes from the prefill) and merged into the batch for the next step.
        """
        self.steps += 1
        outputs: list[StepOutput] = []
        self._drop_finished()
        if self.running:
            logits = self.runner.decode(self.batch, self._last_tokens)
            self._last_tokens = self._sample(self.running, logits)
            outputs += self._postprocess(self.running, self._last_tokens)
        admitted = self._admit()
        if admitted:
            cache, logits = self.runner.prefill(admitted)
            tokens = self._sample(admitted, logits)
            if self.batch is None:
                self.batch, self._last_tokens = cache, tokens
            else:
                self.batch.merge(cache)
                self._last_tokens = torch.cat([self._last_tokens, tokens])
            for seq in admitted:
                seq.status = SequenceStatus.RUNNING
            self.running.extend(admitted)
            outputs += self._postprocess(admitted, tokens)
        if not self.has_unfinished():  # idle: the last steps' observations reach metrics and policies
            self.runner.flush()
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """`logits (B, V)` -> `(B,)` next tokens. A row whose sampling raises fails its sequence alone."""
        errors: list[tuple[int, Exception]] = []
        tokens = sample_next_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs], errors)
        for i, exc in errors:
            _fail(seqs[i], "sampling", exc)
        return tokens

    def _postprocess(self, seqs: list[Sequence], tokens: torch.Tensor) -> list[StepOutput]:
        now = time.perf_counter()
        out = []
        for seq, tok in zip(seqs, tokens.tolist(), strict=True):  # NOTE: host sync, once per step
            if seq.finished:  # aborted or failed while in flight: its row leaves at the next step
                continue
            before = len(seq.output_ids)
            try:
                done = self._append_token(seq, tok, now)
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer: this sequence's own failure
                _fail(seq, "postprocessing", exc)
                done = True
            out.append(StepOutput(seq, seq.output_ids[before:], done))
        return out

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self.running) if not s.finished]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.batch.close()
            self.batch, self._last_tokens = None, None
            return
        self.batch.keep_rows(keep)
        self._last_tokens = self._last_tokens.index_select(
            0, torch.tensor(keep, device=self._last_tokens.device)
        )


def _fail(seq: Sequence, stage: str, exc: Exception) -> None:
    """End one sequence with finish_reason "error"; the others of the batch carry on."""
    seq.error = f"{stage} failed: {type(exc).__name__}: {exc}"
    seq.finish("error")
