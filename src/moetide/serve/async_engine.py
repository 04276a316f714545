"""The engine thread: owns one `LLMEngine`, steps it while there is work, streams deltas to asyncio.

Handoff between the event loop and the engine thread:

    event loop    submit() / abort()  -> inbox and abort list (a deque under a Condition; a few
                                         appends, so the event loop never waits on a step)
    engine thread takes the inbox -> LLMEngine.add_request / abort -> step() -> for each request
                  with news: loop.call_soon_threadsafe(queue.put_nowait, RequestEvent)
    event loop    `async for event in stream` reads that request's asyncio.Queue

Only the engine thread touches the `LLMEngine` (and through it the model and residency core). It
sleeps on the Condition while there is nothing to do. An exception inside `step()` fails the
requests in the batch with an "error" event and the thread carries on with the queued ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

from ..engine.detokenize import stable_prefix
from ..engine.llm_engine import LLMEngine
from ..engine.sampling import SamplingParams
from ..engine.sequence import Sequence
from ..errors import ConfigError, MoetideError
from .metrics import ServerMetrics

log = logging.getLogger("moetide.serve")


class QueueFullError(MoetideError):
    """`max_queue` requests are already waiting; try again later (HTTP 429)."""


class EngineStoppedError(MoetideError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class RequestEvent:
    """News about one request: text and tokens added since the previous event, or its end.

    `num_output_tokens` is the running total. A finished event carries `finish_reason`
    ("stop" | "length" | "abort" | "error") and, for "error", a message in `error`.
    """

    text: str
    token_ids: list[int]
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """One submitted request, as the event loop sees it: its id and an async iterator of events."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival_s = time.perf_counter()
        self.finished = False  # set once the final event has been read
        self._loop = loop
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()

    def push(self, event: RequestEvent) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def __aiter__(self):
        while not self.finished:
            event = await self._queue.get()
            self.finished = event.finished
            yield event


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one request."""

    stream: RequestStream
    seq: Sequence | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    error: str | None = None
    hold_back_chars: int = 0  # trailing characters not streamed yet (a stop string may start there)


class AsyncEngine:
    """Runs `engine` on a thread of its own and serves requests from asyncio code.

    Args:
        engine: the engine loop; from `start()` on, only this object's thread may touch it.
        loaded: the `LoadedModel`, for expert-residency metrics (None = no expert metrics).
        max_queue: requests allowed to wait for a batch slot (beyond those the next step can admit);
            one more is refused with `QueueFullError`.
        metrics: where Prometheus series go (a new registry per instance by default).
        expert_metrics_interval_s: how often the engine thread refreshes the expert snapshot while busy.
        step_log: a path the engine thread appends one JSON line per iteration to (what it ran, how
            long; `moetide serve --step-log`); None: no step log.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        loaded=None,
        max_queue: int = 256,
        metrics: ServerMetrics | None = None,
        expert_metrics_interval_s: float = 0.5,
        step_log: str | None = None,
    ):
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.loaded = loaded
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.expert_metrics_interval_s = expert_metrics_interval_s
        # fixed engine limits, readable from any thread
        self.max_num_seqs = engine.max_num_seqs
        self.max_model_len = engine.max_model_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self.vocab_size = _vocab_size(engine)
        self._cond = threading.Condition(threading.Lock())
        # guarded by _cond:
        self._inbox: deque[RequestStream] = deque()
        self._aborts: list[str] = []
        self._engine_waiting = 0
        self._engine_running = 0
        self._stopping = False
        self._cancel = False
        # engine thread only:
        self._tracked: dict[str, _Tracked] = {}
        self._last_expert_refresh_s = 0.0
        self._thread: threading.Thread | None = None
        self._step_log = _open_step_log(step_log)

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._refresh_expert_metrics(force=True)
        self._thread = threading.Thread(target=self._run, name="moetide-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self.is_alive and not self._stopping

    def begin_shutdown(self) -> None:
        """Refuse new requests; the ones already accepted keep running."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def cancel_all(self) -> None:
        """Refuse new requests and end every accepted one now (finish_reason "abort"); returns at once."""
        with self._cond:
            self._stopping = True
            self._cancel = True
            self._cond.notify()

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Graceful stop: let accepted requests finish for up to `drain_timeout_s`, then cancel the rest
        (their streams end with finish_reason "abort") and join the thread. Blocks; call it off the
        event loop (`asyncio.to_thread`)."""
        self.begin_shutdown()
        if self._thread is None:
            return
        self._thread.join(drain_timeout_s)
        if self._thread.is_alive():
            self.cancel_all()
            self._thread.join()

    # -- the event loop's side ----------------------------------------------------------------------------
    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; call from a running event loop. Never waits on the engine.

        Raises:
            ConfigError: the prompt cannot run (empty, ids outside the vocabulary, longer than the context).
            QueueFullError: `max_queue` requests are already waiting.
            EngineStoppedError: shutting down.
        """
        self._check_prompt(prompt_ids, params)
        stream = RequestStream(
            request_id or _new_request_id(), list(prompt_ids), params, asyncio.get_running_loop()
        )
        with self._cond:
            if self._stopping or not self.is_alive:
                raise EngineStoppedError("the server is shutting down")
            # requests that the next step will admit into free batch slots are not queued
            free_slots = max(0, self.max_num_seqs - self._engine_running)
            if len(self._inbox) + self._engine_waiting >= self.max_queue + free_slots:
                self.metrics.rejected.labels("queue_full").inc()
                raise QueueFullError(f"{self.max_queue} requests are already waiting; retry later")
            self._inbox.append(stream)
            self.metrics.waiting.set(len(self._inbox) + self._engine_waiting)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, waiting or running); its KV rows are freed at the next step."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        """Requests waiting (not yet in the batch) and running, as of the last step."""
        with self._cond:
            return {"waiting": len(self._inbox) + self._engine_waiting, "running": self._engine_running}

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in prompt_ids
        ):
            raise ConfigError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len} (prompt + output)"
            )
        need = min(self.max_model_len, len(prompt_ids) + params.max_tokens)
        if need > self.kv_capacity_tokens:
            raise ConfigError(
                f"prompt + max_tokens = {need} tokens; the KV cache holds {self.kv_capacity_tokens}:"
                " lower max_tokens"
            )

    # -- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                idle = not (self._inbox or self._aborts or self._stopping or self._tracked)
            if idle:
                self._refresh_expert_metrics(force=True)
            with self._cond:
                while not (self._inbox or self._aborts or self._stopping or self._tracked):
                    self._cond.wait()
                new = list(self._inbox)
                self._inbox.clear()
                self._engine_waiting += len(new)
                aborts, self._aborts = self._aborts, []
                cancel = self._cancel
                if self._stopping and not new and not self._tracked:
                    return
            try:
                self._iteration(new, aborts, cancel)
            except Exception as exc:  # a bug outside step(): fail what is in flight, keep serving
                log.exception("engine thread error")
                try:
                    self._fail_in_flight(exc, everything=True)
                    self._publish_counts()
                    self._deliver()
                except Exception:
                    log.exception("could not fail the requests one by one; dropping them all")
                    self._drop_all(f"internal error: {type(exc).__name__}: {exc}")
            self._refresh_expert_metrics()
            if cancel and not self._tracked:
                with self._cond:
                    if not self._inbox:
                        return

    def _iteration(self, new: list[RequestStream], aborts: list[str], cancel: bool) -> None:
        for stream in new:
            self._add(stream)
        if cancel:
            aborts = aborts + list(self._tracked)
        for request_id in aborts:
            if request_id in self._tracked:
                self.engine.abort(request_id)
        start = time.perf_counter()
        stepped = self.engine.has_unfinished()
        if stepped:
            try:
                self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing the requests in the batch")
                self.metrics.engine_errors.inc()
                self._fail_in_flight(exc)
        stepped_s = time.perf_counter()
        self._publish_counts()  # before the events: a client that reacts to one sees current counts
        self._deliver()
        if self._step_log is not None:
            self._log_iteration(start, stepped_s, len(new), stepped)

    def _log_iteration(self, start: float, stepped_s: float, added: int, stepped: bool) -> None:
        """One line of the step log: when (perf_counter s), the step's and the delivery's seconds,
        requests added, and the step's shape (`LLMEngine.last_step`)."""
        line = {"t": round(start, 4), "step_s": round(stepped_s - start, 5),
                "deliver_s": round(time.perf_counter() - stepped_s, 5), "added": added,
                **(self.engine.last_step if stepped else {})}  # fmt: skip
        try:
            self._step_log.write(json.dumps(line) + "\n")
        except (OSError, ValueError):  # a full disk must not take the engine down
            self._step_log = None

    def _add(self, stream: RequestStream) -> None:
        tracked = _Tracked(stream)
        self._tracked[stream.request_id] = tracked
        try:
            seq = self.engine.add_request(stream.prompt_ids, stream.params, request_id=stream.request_id)
        except Exception as exc:  # noqa: BLE001 - checked in submit(); what is left is this request's own
            log.warning("request %s refused by the engine: %s", stream.request_id, exc)
            tracked.seq = _failed_sequence(stream)
            tracked.error = str(exc)
            return
        seq.arrival_s = stream.arrival_s  # TTFT counts the time spent in the inbox too
        tracked.seq = seq
        if stream.params.stop:
            # text that could still become a stop string is held back until it cannot
            tracked.hold_back_chars = max(len(s) for s in stream.params.stop) - 1
        self.metrics.prompt_tokens.inc(len(stream.prompt_ids))

    def _fail_in_flight(self, exc: Exception, *, everything: bool = False) -> None:
        """After a failed step, end every request of the batch with an error; queued requests keep
        their place unless `everything` (a failure outside the step, where nothing can be trusted)."""
        message = f"internal error while generating: {type(exc).__name__}: {exc}"
        try:
            self.engine.fail_running("error")
        except Exception:  # pragma: no cover - recovery must not raise
            log.exception("could not reset the running batch")
        waiting = {s.request_id for s in self.engine.waiting}
        for tracked in self._tracked.values():
            if tracked.seq is None:
                tracked.seq = _failed_sequence(tracked.stream)
            seq = tracked.seq
            if seq.finished:
                if seq.finish_reason == "error" and tracked.error is None:
                    tracked.error = message
                continue
            if seq.request_id in waiting:
                if not everything:
                    continue
                self.engine.abort(seq.request_id)  # leaves the queue
            # admitted by the failed step: in neither the queue nor the batch
            seq.finish("error")
            tracked.error = message

    def _drop_all(self, message: str) -> None:
        """Last resort: end every tracked request with an error event and forget it."""
        for request_id, tracked in self._tracked.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort: the batch is reset below anyway
                log.debug("abort of %s failed during recovery", request_id)
            tracked.stream.push(RequestEvent("", [], tracked.sent_tokens, True, "error", message))
            self.metrics.finished.labels("error").inc()
        self._tracked.clear()
        try:
            self.engine.fail_running("error")
        except Exception:  # pragma: no cover - best effort
            log.exception("could not reset the running batch")

    def _deliver(self) -> None:
        """Push what each request gained since the last event; finished requests leave the table."""
        for request_id, tracked in list(self._tracked.items()):
            seq = tracked.seq
            num_tokens = len(seq.output_ids)
            if num_tokens == tracked.sent_tokens and not seq.finished:
                continue
            text = seq.text if seq.finished else stable_prefix(seq.text, tracked.hold_back_chars)
            delta = text[tracked.sent_chars :] if len(text) > tracked.sent_chars else ""
            new_ids = list(seq.output_ids[tracked.sent_tokens : num_tokens])
            if tracked.sent_tokens == 0 and num_tokens > 0 and seq.first_token_s is not None:
                self.metrics.ttft_s.observe(seq.first_token_s - tracked.stream.arrival_s)
            self.metrics.generation_tokens.inc(max(0, num_tokens - tracked.sent_tokens))
            tracked.sent_tokens = num_tokens
            tracked.sent_chars += len(delta)
            if seq.finished:
                reason = seq.finish_reason or "abort"
                error = tracked.error or seq.error or ("internal error" if reason == "error" else None)
                event = RequestEvent(delta, new_ids, num_tokens, True, reason, error)
                self._observe_finished(seq, tracked.stream, reason)
                del self._tracked[request_id]
            else:
                event = RequestEvent(delta, new_ids, num_tokens)
            tracked.stream.push(event)

    def _observe_finished(self, seq: Sequence, stream: RequestStream, reason: str) -> None:
        self.metrics.finished.labels(reason).inc()
        if seq.tpot_s is not None:
            self.metrics.tpot_s.observe(seq.tpot_s)
        if seq.finish_s is not None and seq.output_ids:
            self.metrics.e2e_s.observe(seq.finish_s - stream.arrival_s)

    def _publish_counts(self) -> None:
        running = sum(1 for s in self.engine.running if not s.finished)
        with self._cond:
            self._engine_waiting = len(self.engine.waiting)
            self._engine_running = running
            waiting = len(self._inbox) + self._engine_waiting
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(running)

    def _refresh_expert_metrics(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_expert_refresh_s < self.expert_metrics_interval_s:
            return
        self._last_expert_refresh_s = now
        try:
            self.metrics.kv_snapshot = self.engine.kv_stats()
        except Exception:  # metrics must never take the engine down
            log.exception("could not read the KV cache metrics")
        if self.loaded is None:
            return
        try:
            runtime = self.loaded.runtime
            snapshot = runtime.metrics.snapshot(resident=runtime.residency.resident_counts())
            snapshot.pop("per_layer", None)
            self.metrics.expert_snapshot = snapshot
        except Exception:  # metrics must never take the engine down
            log.exception("could not read the expert metrics")


def _open_step_log(path: str | None):
    """The step log at `path`, appended to and line-buffered (it lives as long as the engine thread), or
    None."""
    if not path:
        return None
    try:
        return open(path, "a", buffering=1)  # noqa: SIM115
    except OSError as e:
        raise ConfigError(f"--step-log {path}: cannot write the step log there ({e.strerror})") from None


def _failed_sequence(stream: RequestStream) -> Sequence:
    """A finished stand-in for a request the engine never took."""
    seq = Sequence(stream.prompt_ids, SamplingParams(), request_id=stream.request_id)
    seq.finish("error")
    return seq


def _vocab_size(engine: LLMEngine) -> int:
    model = engine.runner.model
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    return int(model.config.vocab_size)


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
