"""The layer feed: policies see each MoE layer of the running step while the device computes the rest.

FineMoE predicts a step's later layers from its earlier ones (the trajectory search), LRU from the
next router applied to this layer's input, MoE-Infinity from the request's counts so far. Deciding a
step later (`TABLE_LAG`) throws that away: the prediction is for a step that has passed. With the
feed, nothing in the step waits for the host, and yet the policies act within it:

    device (compute stream)                        host (the feed's thread)
    embedding -> embed copy, step word 0  ------->  begin_iteration(embedding)
    layer l routes -> row copy, step word 1+l ---->  observe_layer(l), observe_speculative(l)
    layer l's experts (read the device table)        residency.in_step(step, l): prefetches for
    layer l+1 routes ...                              layers > l start now, publish when they land

The device writes the words (`compute.observations.StepObservations.publish_layer`); the thread
polls them on a GPU (pinned memory the copy lands in) and is woken on the CPU (where the "copy" is
done when the call returns). A step the thread falls behind on is dropped from the point it was
overtaken (its data overwritten): the policies see a shorter step, the device never waits.
Not under `--deterministic`, where every decision waits for a step boundary instead.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

import torch

POLL_S = 20e-6  # between looks at pinned memory (GPU): well under a layer's time
PUMP_S = 0.25e-3  # between looks at late decisions (a searcher's) while a layer computes
SWITCH_S = 2e-4  # the interpreter's thread switch interval while a feed runs on the CPU
GIVE_UP_S = 5.0  # a step announced but never run (its forward failed): stop waiting for it


class LayerFeed:
    """A thread that publishes the running step's layers to `hooks` (a `PolicyHooks`) as the device
    routes them, and lets the residency (`sink.in_step`) act on their requests within the step.

    Args:
        hooks: the `PolicyHooks` whose policies observe (`publish_begin/_layer/_end`).
        observations: the runtime's `StepObservations` (its feed is switched on here).
        sink: the residency core (`in_step(iteration, routed)`), or anything without it.
        num_layers: MoE layers per step.
    """

    def __init__(self, hooks, observations, sink, num_layers: int):
        self.hooks = hooks
        self.obs = observations
        self.sink = sink
        self.num_layers = num_layers
        self.poll = observations.device.type == "cuda"
        self._cv = threading.Condition()
        self._steps: deque = deque()  # (iteration, tokens, real tokens, request ids) from the runtime
        self._stop = False
        self._busy = False  # the thread is following a step
        self.steps_seen = 0  # steps published whole
        self.steps_cut = 0  # steps the thread was overtaken on (published in part)
        self.layers_seen = 0
        self.copies_started = 0  # in-step prefetches the residency started
        self.errors: list[str] = []
        observations.want(feed=True)
        if hasattr(sink, "in_step_fed"):
            sink.in_step_fed = True
        self._switch_interval = None  # the interpreter's own, restored on close
        if not self.poll:
            observations.on_publish.append(self._wake)
            # on the CPU the forward pass holds the GIL between ops: hand it over often enough that
            # this thread (and the copy worker) act within a layer, not 5 ms (Python's default) later
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, SWITCH_S))
        self._thread = threading.Thread(target=self._run, name="moetide-layer-feed", daemon=True)
        self._thread.start()

    # -- the forward thread -------------------------------------------------------------------------
    def announce(self, iteration: int, tokens: int | None, request_ids, real: int | None = None) -> None:
        """A step of `tokens` tokens, the first `real` of them real (all unless given; the rest pad
        rows, never published), is about to run (the runtime's `begin_step`)."""
        if tokens is None:
            return
        with self._cv:
            self._steps.append((iteration, tokens, real if real is not None else tokens, tuple(request_ids)))
            self._cv.notify_all()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        if self._wake in self.obs.on_publish:
            self.obs.on_publish.remove(self._wake)
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every announced step has been handled (tests; the end of a traced run)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._steps or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    # -- the feed's thread --------------------------------------------------------------------------
    def _wait_for(self, slot: int, iteration: int, routed: int | None = None) -> bool:
        """Until slot `slot` holds step `iteration` (True) or a later one (False: overtaken). Meanwhile
        (`routed`: the step's last layer seen) decisions that arrive late, from a searcher, still
        reach the residency before the layers they are for."""
        start = pumped = time.monotonic()
        while True:
            seen = self.obs.feed_seq(slot)
            if seen >= iteration:
                return seen == iteration
            now = time.monotonic()
            if self._stop or now - start > GIVE_UP_S:
                return False
            if routed is not None and self.hooks.enabled and now - pumped >= PUMP_S:
                pumped = now
                self._pump(iteration, routed)
            if self.poll:
                time.sleep(POLL_S)
            else:
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or self.obs.feed_seq(slot) >= iteration, timeout=PUMP_S)

    def _pump(self, iteration: int, routed: int) -> None:
        for p in self.hooks.policies:
            if hasattr(p, "poll"):
                p.poll()
        has_requests = getattr(self.sink, "has_requests", None)
        if has_requests is not None and has_requests():
            self.copies_started += self.sink.in_step(iteration, routed)

    def _run(self) -> None:
        torch.set_num_threads(1)  # this thread's numpy/torch work is small; leave the cores to the step
        while True:
            with self._cv:
                while not self._steps and not self._stop:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                if self._stop:
                    return
                step = self._steps.popleft()
                self._busy = True
            try:
                self._follow(*step)
            except Exception as e:  # noqa: BLE001 - a policy's failure must never take the engine down
                self.errors.append(f"{type(e).__name__}: {e}")

    def _follow(self, iteration: int, tokens: int, real: int, request_ids: tuple) -> None:
        """Publish step `iteration`'s layers (its first `real` rows of `tokens`) as they land, up to
        where a later step overtakes it."""
        embed = None
        if self.obs.want_embed:
            if not self._wait_for(0, iteration):
                self.steps_cut += 1
                return
            data = self.obs.feed_read(0, iteration, tokens, real)
            if data is None:
                self.steps_cut += 1
                return
            embed = data["embed"]
        self.hooks.publish_begin(iteration, embed, real, request_ids)
        in_step = getattr(self.sink, "in_step", None) if self.hooks.enabled else None
        if in_step is not None:  # the semantic predictions of the first layers (free slots only)
            self.copies_started += in_step(iteration, -1)
        for layer in range(self.num_layers):
            arrived = self._wait_for(1 + layer, iteration, routed=layer - 1)
            data = self.obs.feed_read(1 + layer, iteration, tokens, real) if arrived else None
            if data is None:
                self.steps_cut += 1
                return
            self.hooks.publish_layer(iteration, layer, data)
            self.layers_seen += 1
            if in_step is not None:
                self.copies_started += in_step(iteration, layer, data["ids"])
        self.hooks.publish_end(iteration)
        self.steps_seen += 1

    def stats(self) -> dict:
        return {
            "steps_seen": self.steps_seen,
            "steps_cut": self.steps_cut,
            "layers_seen": self.layers_seen,
            "copies_started": self.copies_started,
            "errors": len(self.errors),
        }
