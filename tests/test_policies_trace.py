"""Traces: recording from a plain transformers model, file round trip, selection; and the asynchronous
FineMoE searcher, which must never block the forward pass."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from moetide.analysis.synthetic import synthetic_trace
from moetide.analysis.trace import Trace, TraceRecorder, greedy_generate, record_trace
from moetide.models.registry import get_adapter
from moetide.policies.finemoe import FineMoEPolicy
from moetide.policies.hooks import PolicyHooks


def tiny_qwen3_moe(num_layers: int = 3, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)  # skewed routing, so that it matters
    return model


PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen3_moe()


@pytest.fixture(scope="module")
def tiny_trace(tiny):
    return record_trace(tiny, get_adapter("qwen3_moe"), PROMPTS, 5, spec_distances=(1, 2))


def test_record_trace_shapes_and_steps(tiny_trace):
    t = tiny_trace
    assert len(t) == 3 * 5  # per request: 1 prefill + 4 decode steps (5 new tokens)
    assert t.requests() == [0, 1, 2]
    assert t.num_tokens == (6 + 4) + (3 + 4) + (4 + 4)
    m = t.meta
    assert (m.num_layers, m.num_experts, m.top_k, m.hidden_size) == (3, 8, 2, 64)
    assert m.moe_layer_ids == (0, 1, 2) and m.spec_distances == (1, 2)
    assert m.extra["prompt_ids"] == PROMPTS
    s0, s1 = t.step(0), t.step(1)
    assert (s0.kind, s0.num_tokens, s1.kind, s1.num_tokens) == ("prefill", 6, "decode", 1)
    assert torch.allclose(s0.gate_probs.sum(-1), torch.ones(3), atol=2e-3)  # float16 storage
    assert s0.spec_topk.shape == (6, 2, 3, 2)
    assert s0.spec(2, 1) is None and s0.spec(1, 2) is None  # beyond the last layer
    assert int(s0.spec_topk[:, 0, 2].max()) == -1 and int(s0.spec_topk[:, 1, 1:].max()) == -1
    assert 0 <= int(s0.spec(0, 1).min()) and int(s0.spec(0, 2).max()) < 8


def test_recorded_routing_matches_transformers(tiny, tiny_trace):
    out = tiny(input_ids=torch.tensor([PROMPTS[0]]), output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.float(), -1)
        expected = torch.topk(probs, 2, dim=-1).indices
        assert torch.equal(tiny_trace.step(0).layer_topk(layer), expected)
        assert torch.allclose(tiny_trace.step(0).gate_probs[layer], probs.mean(0), atol=1e-3)


def test_recorded_greedy_tokens_match_generate(tiny):
    res = greedy_generate(tiny, PROMPTS[:1], 5)
    ref = tiny.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=False)
    assert res.tokens[0] == ref[0, len(PROMPTS[0]) :].tolist()


def test_trace_round_trip_and_selection(tmp_path, tiny_trace):
    path = tiny_trace.save(tmp_path / "run.trace.safetensors")
    t = Trace.load(path)
    assert t.meta == tiny_trace.meta
    for name in (
        "request_ids",
        "step_kinds",
        "token_offsets",
        "embeddings",
        "gate_probs",
        "topk_ids",
        "spec_topk",
    ):
        assert torch.equal(getattr(t, name), getattr(tiny_trace, name)), name
    one = t.select_requests([2])
    assert len(one) == 5 and one.requests() == [2]
    assert torch.equal(one.step(0).topk_ids, t.step(10).topk_ids)
    both = Trace.concat([one, t.select_requests([0])])
    assert both.requests() == [2, 0] and both.num_tokens == 8 + 10
    assert torch.equal(both.step(5).spec_topk, t.step(0).spec_topk)


def test_load_rejects_non_traces(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a moetide trace"):
        Trace.load(tmp_path / "x.safetensors")


def test_dense_first_layers_are_skipped():
    """DeepSeek-V2 with a dense first layer: MoE ordinals 0, 1 are model layers 1, 2."""
    from tiny_models import make_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("deepseek_v2"), dtype=torch.float32).eval()
    t = record_trace(model, get_adapter("deepseek_v2"), [[3, 4, 5]], 2, spec_distances=(1,))
    assert t.meta.moe_layer_ids == (1, 2) and t.meta.num_layers == 2 and len(t) == 2


# -- the asynchronous searcher never blocks the forward pass ------------------------------------------
class BlockedSink:
    """A sink whose every call waits until `release()` (a congested copy engine, a held lock...):
    while blocked, a searcher that calls it is stuck in the call."""

    def __init__(self, capacity_experts: int = 16, released: bool = False):
        self.capacity_experts = capacity_experts
        self._released = threading.Event()
        if released:
            self._released.set()
        self.entered = 0  # calls begun (some may still be waiting)
        self.calls = 0  # calls done

    def _call(self) -> None:
        self.entered += 1
        self._released.wait()
        self.calls += 1

    def prefetch(self, layer, experts, *, iteration, priorities=None, protect=False):
        self._call()

    def protect(self, layer, experts, *, iteration):
        self._call()

    def set_precision(self, layer, expert, precision):
        self._call()

    def release(self) -> None:
        self._released.set()


def blocked_searcher(policy, searcher: str):
    """A generator: a searcher that cannot make progress. thread: the sink blocks every call of
    the searcher thread until resumed. process: the searcher process is stopped (SIGSTOP). The first
    `next` gives the sink to attach; the second blocks the searcher and the third (or `close`)
    resumes it."""
    sink = BlockedSink(released=searcher != "thread")
    yield sink
    process = policy._process
    if process is not None:
        deadline = time.monotonic() + 60
        while not process.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(process._child.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if process is not None:
            os.kill(process._child.pid, signal.SIGCONT)
        sink.release()


def finishes_while_the_searcher_is_blocked(work, hang_s: float = 60.0):
    """Run `work()` on a thread of its own: whether it returned (a forward thread that waited for
    the blocked searcher would never return; `hang_s` only bounds the test)."""
    errors: list[BaseException] = []

    def run():
        try:
            work()
        except BaseException as e:  # noqa: BLE001 -- re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(hang_s)
    if errors:
        raise errors[0]
    return not thread.is_alive()


@pytest.mark.parametrize("searcher", ["thread", "process"])
def test_forward_thread_calls_never_wait_for_a_blocked_searcher(searcher):
    warm = synthetic_trace([0, 1, 2, 3], decode_steps=8)
    policy = FineMoEPolicy(prefetch_distance=1, searcher=searcher)
    blocked = blocked_searcher(policy, searcher)
    sink = next(blocked)
    policy.attach(sink, warm.meta.num_layers, warm.meta.num_experts, warm.meta.top_k)
    policy.warm_up(warm)

    def run(steps):
        for s in steps:
            step = warm.step(s)
            policy.begin_iteration(s, step.embedding, step.num_tokens)
            for layer in range(warm.meta.num_layers):
                policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))
                time.sleep(0.002)  # the layer's compute
            policy.end_iteration(s)

    try:
        next(blocked)  # the searcher is blocked from here on
        # thread: the searcher thread is stuck in a sink call; process: the searcher is stopped.
        # Either way the forward thread's 20 steps finish without it.
        assert finishes_while_the_searcher_is_blocked(lambda: run(range(20))), "the forward thread waited"
        if searcher == "thread":
            assert sink.entered > sink.calls == 0  # the searcher was in the sink all along
        next(blocked, None)  # resume: its backlog is late, later steps are not
        run(range(20, 28))
        assert policy.drain(timeout_s=60)
        assert sink.calls > 0  # the searcher did work (late ones are skipped, by design)
        assert policy.stats()["late_skipped"] > 0
        assert not policy.errors
    finally:
        blocked.close()
        policy.close()


@pytest.mark.parametrize("searcher", ["thread", "process"])
def test_a_blocked_searcher_leaves_outputs_unaffected_and_the_forward_pass_running(tiny, searcher):
    adapter = get_adapter("qwen3_moe")
    plain = greedy_generate(tiny, PROMPTS, 8)

    warm = record_trace(tiny, adapter, PROMPTS, 4, spec_distances=())
    policy = FineMoEPolicy(prefetch_distance=1, searcher=searcher)
    blocked = blocked_searcher(policy, searcher)
    sink = next(blocked)
    hooks = PolicyHooks(tiny, adapter, [policy], sink=sink)
    policy.warm_up(warm)
    hooked = []
    try:
        next(blocked)  # blocked from here on
        generated = finishes_while_the_searcher_is_blocked(
            lambda: hooked.append(greedy_generate(tiny, PROMPTS, 8, hooks=hooks))
        )
        assert generated, "generation waited for the blocked searcher"
        next(blocked, None)  # resume
        policy.drain(timeout_s=120)
        greedy_generate(tiny, PROMPTS[:1], 8, hooks=hooks)  # steps it is in time for
        assert policy.drain(timeout_s=120) and sink.calls > 0 and not policy.errors
    finally:
        blocked.close()
        hooks.remove()
        policy.close()
    assert hooked[0].tokens == plain.tokens


def test_trace_recorder_as_policy_numbers_requests_without_ids():
    rec = TraceRecorder()
    from moetide.policies.hooks import NullSink

    rec.attach(NullSink(), 1, 4, 1)
    for it, tokens in enumerate([3, 1, 1, 2, 1]):
        rec.begin_iteration(it, torch.zeros(2), tokens)
        rec.observe_layer(it, 0, torch.full((4,), 0.25), torch.zeros(tokens, 1, dtype=torch.int64))
        rec.end_iteration(it)
    t = rec.trace()
    assert t.request_ids.tolist() == [0, 0, 0, 1, 1]
    assert [t.step(i).kind for i in range(5)] == ["prefill", "decode", "decode", "prefill", "decode"]


class ObservationLog:
    """A policy that only records what it is shown: (iteration event, layer, probs, ids)."""

    name = "log"
    speculative_distances = ()

    def __init__(self):
        self.events = []

    def attach(self, sink, num_layers, num_experts, top_k):
        pass

    def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()):
        self.events.append(("begin", num_tokens))

    def observe_layer(self, iteration, layer, gate_probs, topk_ids):
        self.events.append(("layer", layer, gate_probs.clone(), topk_ids.clone()))

    def end_iteration(self, iteration):
        self.events.append(("end",))

    def close(self):
        pass


class WholeStepLog(ObservationLog):
    """An `ObservationLog` that takes each step whole (`observe_step`), as the engine's policies do."""

    def observe_step(self, iteration, gate_probs, topk_ids):
        assert gate_probs.dim() == 2 and topk_ids.dim() == 3 and len(gate_probs) == len(topk_ids)
        for layer in range(len(gate_probs)):
            self.events.append(("layer", layer, gate_probs[layer].clone(), topk_ids[layer].clone()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("policy", ["combined", "no-offload"])
def test_observations_published_after_the_runtimes_sync_equal_the_eager_ones(policy, device):
    """With the engine's runtime, a step is published one step late from the host copy of its device
    buffers (for every policy: no host sync in the step); every policy still sees the same layers, in
    the same order, with the same gate probabilities and ids as eager hooks, whether it takes the
    step layer by layer or whole (`observe_step`: one softmax and one cast for every layer)."""
    import moetide

    budget = "25%" if policy == "combined" else None  # combined: host syncs; no-offload: none
    llm = moetide.LLM(device=device, policy=policy, gpu_memory=budget)
    try:
        if llm.loaded.policy_hooks is not None:
            llm.loaded.policy_hooks.remove()
        params = moetide.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        # both observers on the same forward passes: what they publish must be the same numbers
        deferred, whole, eager = ObservationLog(), WholeStepLog(), ObservationLog()
        hooks = [
            PolicyHooks(llm.loaded.model, llm.loaded.adapter, [deferred, whole], runtime=llm.loaded.runtime),
            PolicyHooks(llm.loaded.model, llm.loaded.adapter, [eager]),
        ]
        try:
            llm.generate(["def add(a, b):"], params)
        finally:
            for h in hooks:
                h.remove()
        assert not llm.loaded.runtime.step_observers and llm.metrics.host_syncs == 0
    finally:
        llm.close()
    layers = len(llm.loaded.moe_layers)
    assert len(deferred.events) == len(whole.events) == len(eager.events) == 6 * (layers + 2)
    for got, want in [*zip(deferred.events, eager.events, strict=True), *zip(whole.events, eager.events)]:
        assert got[:2] == want[:2]
        if got[0] == "layer":
            # the same logits, soft-maxed on the host (deferred) or on the device (eager)
            torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=1e-5)
            assert torch.equal(got[3], want[3])


def test_switched_off_hooks_show_the_policies_nothing_and_count_their_time():
    """`PolicyHooks.enabled = False` (how bench_searcher.py measures the engine without the policy)
    publishes nothing, on both the runtime path and the eager path; switched on, every step is shown
    again and the forward thread's time in the hooks is counted."""
    import moetide

    llm = moetide.LLM(device="cpu", policy="combined", gpu_memory="25%")
    try:
        llm.loaded.policy_hooks.remove()
        params = moetide.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        layers = len(llm.loaded.moe_layers)
        for runtime in (llm.loaded.runtime, None):
            log = ObservationLog()
            hooks = PolicyHooks(llm.loaded.model, llm.loaded.adapter, [log], runtime=runtime)
            try:
                hooks.enabled = False
                llm.generate(["def add(a, b):"], params)
                assert log.events == [] and hooks.hook_time_s == 0.0
                hooks.enabled = True
                llm.generate(["def add(a, b):"], params)
                assert len(log.events) == 3 * (layers + 2) and hooks.hook_time_s > 0
            finally:
                hooks.remove()
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("policy", "eviction"), [("finemoe", "prob-freq"), ("combined", "prob-freq"), ("lru", "lru")]
)
def test_the_engine_evicts_by_the_policys_rule_and_sees_the_gate_probabilities(policy, eviction):
    import moetide

    llm = moetide.LLM(device="cpu", policy=policy, gpu_memory="25%")
    try:
        residency = llm.loaded.runtime.residency
        assert residency.options.eviction == eviction
        llm.generate(["def add(a, b):"], moetide.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        residency.settle()  # applies every request
        # every layer's observed gate distribution reached the residency
        assert (residency.stats.prob.sum(axis=1) > 0.5).all()
    finally:
        llm.close()


def test_the_searcher_process_starts_with_the_engine_and_ends_with_it():
    """`--searcher process`: the child starts when the engine is built (before the first step, so
    no step's events wait for its imports), sees every step, and `close` ends it with the store's
    online inserts brought back."""
    import moetide

    llm = moetide.LLM(device="cpu", policy="finemoe", gpu_memory="25%")
    policy = llm.loaded.policy
    process = policy._process
    assert process is not None and process.alive
    deadline = time.monotonic() + 60
    while not process.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    params = moetide.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(["def add(a, b):"], params)
    feed = llm.loaded.policy_hooks.feed  # the layer feed publishes a step's events after the step
    assert feed is None or feed.idle(60)
    assert policy.drain(timeout_s=60)
    stats = policy.stats()
    # one map per step the feed published whole (prefill + 7 decode steps, but the feed cuts a step
    # that overtakes it, as under a loaded CPU: the device never waits, and a cut step stores no map)
    whole = feed.steps_seen if feed is not None else 8
    assert 1 <= whole <= 8
    assert stats["searcher"] == "process" and stats["dropped_events"] == 0 and stats["errors"] == 0
    assert stats["store_size"] == whole
    llm.close()
    assert not process.alive and policy._process is None
    assert len(policy.store) == whole


def test_a_searcher_process_that_dies_leaves_the_engine_serving_and_says_so():
    import moetide

    llm = moetide.LLM(device="cpu", policy="finemoe", gpu_memory="25%")
    try:
        params = moetide.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        want = llm.generate(["def add(a, b):"], params)[0].token_ids
        policy = llm.loaded.policy
        os.kill(policy._process._child.pid, signal.SIGKILL)
        policy._process._child.wait(10)
        assert llm.generate(["def add(a, b):"], params)[0].token_ids == want
        assert not policy.drain(timeout_s=1)
        assert policy.errors == ["the FineMoE searcher process has exited"]
        assert policy.stats()["searcher_alive"] is False
    finally:
        llm.close()


def test_a_full_ring_drops_events_instead_of_waiting_and_the_searcher_skips_those_iterations():
    """The searcher process stopped: once its ring (256 events here) is full, publishing drops the
    event and returns at once; resumed, it handles what it has, skips the iterations whose events
    were dropped, and decides again for the next complete iteration."""
    warm = synthetic_trace([0, 1, 2, 3], decode_steps=8)
    L = warm.meta.num_layers
    policy = FineMoEPolicy(prefetch_distance=1, searcher="process")
    blocked = blocked_searcher(policy, "process")
    sink = next(blocked)
    policy.attach(sink, L, warm.meta.num_experts, warm.meta.top_k)
    policy.warm_up(warm)
    slots = policy._process.event_slots
    steps = slots // (L + 2) + 3  # enough iterations to overflow the ring
    try:
        next(blocked)  # stopped from here on

        def publish_all():
            for s in range(steps):
                step = warm.step(s % len(warm))
                policy.begin_iteration(s, step.embedding, step.num_tokens)
                for layer in range(L):
                    policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))
                policy.end_iteration(s)

        # publishing into the full ring of a stopped process returns: it never waits for room
        assert finishes_while_the_searcher_is_blocked(publish_all), (
            "publishing waited for the stopped searcher"
        )
        assert policy.stats()["dropped_events"] == steps * (L + 2) - slots
        next(blocked, None)  # resume
        assert policy.drain(timeout_s=60)
        calls_before = sink.calls
        step = warm.step(0)
        s = steps
        policy.begin_iteration(s, step.embedding, step.num_tokens)
        for layer in range(L):
            time.sleep(0.01)  # time enough for each search
            policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))
        policy.end_iteration(s)
        assert policy.drain(timeout_s=60) and not policy.errors
        assert sink.calls > calls_before  # a complete iteration after the drops is searched again
    finally:
        blocked.close()
        policy.close()


class RecordingSink:
    capacity_experts = 16

    def __init__(self):
        self.calls = []

    def prefetch(self, layer, experts, *, iteration, priorities=None, protect=False):
        rounded = None if priorities is None else [round(float(p), 6) for p in priorities]
        self.calls.append(("prefetch", iteration, layer, list(experts), rounded, protect))

    def protect(self, layer, experts, *, iteration):
        self.calls.append(("protect", iteration, layer, list(experts)))

    def set_precision(self, layer, expert, precision):
        self.calls.append(("precision", layer, expert, precision))


def _inline_and_process_decisions(publish, **config):
    """Replay a synthetic trace through FineMoE with the inline handler and with the searcher process,
    `publish(policy, searcher, s, step)` showing each step's layers; returns {searcher: (sink calls,
    store, stats)}. Each step's events are drained before the next (the engine never waits like this)."""
    warm = synthetic_trace([0, 1, 2, 3], decode_steps=8)
    meta = warm.meta
    out = {}
    for searcher in ("inline", "process"):
        policy = FineMoEPolicy(prefetch_distance=1, searcher=searcher, **config)
        sink = RecordingSink()
        policy.attach(sink, meta.num_layers, meta.num_experts, meta.top_k)
        policy.warm_up(warm.select_requests([0, 1]))
        try:
            for s in range(len(warm)):
                step = warm.step(s)
                policy.begin_iteration(s, step.embedding, step.num_tokens)
                publish(policy, searcher, s, step)
                policy.end_iteration(s)
                assert policy.drain(timeout_s=60)
            assert not policy.errors
        finally:
            policy.close()
        out[searcher] = sink.calls, policy.store, policy.stats()
    return out


def _assert_same_decisions(decisions) -> None:
    (calls, store, _), (inline_calls, inline_store, _) = decisions["process"], decisions["inline"]
    assert len(inline_calls) > 0 and calls == inline_calls
    assert len(store) == len(inline_store)
    torch.testing.assert_close(store.map(len(store) - 1), inline_store.map(len(store) - 1))


def test_the_searcher_process_decides_what_the_inline_handler_decides():
    """Given time for every search (the forward pass waits for the searcher after each publish, which
    the engine never does), the process makes the same sink calls, in the same order, with the same
    priorities, as the handler run inline; and its store ends with the same online inserts."""

    def layer_by_layer(policy, searcher, s, step):
        assert policy.drain(timeout_s=60)
        for layer in range(len(step.gate_probs)):
            policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))
            assert policy.drain(timeout_s=60)

    decisions = _inline_and_process_decisions(layer_by_layer)
    assert all(stats["late_skipped"] == 0 for _, _, stats in decisions.values())
    _assert_same_decisions(decisions)


def test_a_whole_step_published_at_once_decides_what_its_layers_published_one_by_one_decide():
    """The engine publishes a finished step whole (`observe_step`): the searcher process gets its L
    layer events in one ring write, every layer's distinct experts counted at once. In the engine's
    step-late mode (lookahead 1), prefill steps included, the sink calls and priorities and the
    store's inserts equal those of the inline handler fed layer by layer."""

    warm = synthetic_trace([0, 1, 2, 3], decode_steps=8)
    assert any(warm.step(s).num_tokens > 1 for s in range(len(warm)))  # distinct counts matter

    def whole_or_by_layer(policy, searcher, s, step):
        if searcher == "process":
            policy.observe_step(s, step.gate_probs, step.topk_ids.transpose(0, 1).contiguous())
            return
        for layer in range(len(step.gate_probs)):
            policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))

    decisions = _inline_and_process_decisions(whole_or_by_layer, lookahead=1)
    assert all(stats["dropped_events"] == 0 for _, _, stats in decisions.values())
    _assert_same_decisions(decisions)


def test_a_paused_searcher_process_reads_every_event_and_decides_nothing():
    """`pause_searches(True)`: the child consumes what the hooks publish (the ring never fills) but
    searches, inserts and decides nothing; unpaused, the same steps are searched and decided again."""
    warm = synthetic_trace([0, 1, 2, 3], decode_steps=8)
    meta = warm.meta
    policy = FineMoEPolicy(prefetch_distance=1, searcher="process")
    sink = RecordingSink()
    policy.attach(sink, meta.num_layers, meta.num_experts, meta.top_k)
    policy.warm_up(warm.select_requests([0, 1]))

    def replay():
        for s in range(min(len(warm), 12)):
            step = warm.step(s)
            policy.begin_iteration(s, step.embedding, step.num_tokens)
            for layer in range(meta.num_layers):
                policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))
                assert policy.drain(timeout_s=60)
            policy.end_iteration(s)
            assert policy.drain(timeout_s=60)

    try:
        stored = len(policy.store)
        policy.pause_searches(True)
        before = policy.stats()
        replay()
        paused = policy.stats()
        assert sink.calls == []
        assert paused["semantic_searches"] + paused["trajectory_searches"] == (
            before["semantic_searches"] + before["trajectory_searches"]
        )
        policy.pause_searches(False)
        replay()
        assert policy.stats()["trajectory_searches"] > paused["trajectory_searches"] and sink.calls
        policy._sync_store_from_process()
        assert len(policy.store) > stored  # online inserts resumed (none while paused)
    finally:
        policy.close()
    with pytest.raises(ValueError, match="searcher process"):
        FineMoEPolicy(prefetch_distance=1, searcher="thread").pause_searches(True)
