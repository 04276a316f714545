"""Trace-driven benchmarks: routing recorded on a real model, replayed onto a model with real expert sizes.

A trace (`analysis.trace`) holds, per forward step, the top-k experts every token picked at every
layer. `TraceReplay` makes a live model route exactly that way: a forward hook on each router
*instance* (`mlp.<adapter.router_attr>`, no class patching) replaces the router's output
`(logits (T, J), weights (T, k), ids (T, k))` with

    ids      the trace's ids for this step and layer
    logits   log of the trace's mean gate probabilities for this step and layer, on every row, so
             that policies observing the router (FineMoE's expert maps) see the recorded distribution
    weights  the live router's softmax at the forced ids, renormalised (only the model's numbers
             depend on them; they are random on a synthetic model anyway)

Speculative router calls (the `lru` policy asks router l+d for its pick on layer l's input, from
inside router l's hook chain) get the trace's recorded speculative ids `spec_topk` when the trace
has them for that distance, and the live router's own pick otherwise (counted as unrecorded).

Steps are consumed in order, one per model forward (the embedding layer starts a step), so the
engine must run one request at a time (batch 1) with prompts of the trace's prefill lengths, each
prompt in one forward (<= the runner's prefill chunk). A forward whose token count differs from the
trace step's raises `TraceReplayError` rather than replaying the wrong routing.

What the replay does *not* carry: token ids of decode steps (the live model samples its own tokens,
so FineMoE's semantic search sees the synthetic model's embeddings of those tokens; prefill tokens
are the recorded prompts when the trace stores them in `meta.extra["prompt_ids"]`).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from ..errors import ConfigError
from ..analysis.trace import STEP_PREFILL, Trace
from .workload import BenchRequest


class TraceReplayError(ConfigError):
    """The trace and the live run disagree (geometry, step lengths, or the trace ran out)."""


def trace_geometry_overrides(model_type: str, trace: Trace) -> dict:
    """Config overrides that give a synthetic `model_type` the trace's routing geometry (L, J, k)."""
    from ..models.registry import get_adapter

    adapter = get_adapter(model_type)
    m = trace.meta
    return {
        "num_hidden_layers": m.num_layers,
        adapter.num_experts_attr: m.num_experts,
        adapter.top_k_attr: m.top_k,
    }


class TraceReplay:
    """Forward hooks that force `trace`'s routing onto `model`, one trace step per model forward.

    Args:
        model: transformers' MoE model (with or without managed experts).
        adapter: the family adapter (router attribute, config fields).
        trace: the recording; its steps are replayed from `start_step`.

    Counters: `steps` (forwards replayed), `forced_layers` (router calls replaced),
    `speculative_forced` / `speculative_unrecorded` (speculative router calls).
    """

    def __init__(self, model, adapter, trace: Trace, *, start_step: int = 0):
        from ..policies.hooks import moe_layers

        layers = moe_layers(model, adapter)
        m = trace.meta
        have = (len(layers), adapter.num_experts(model.config), adapter.top_k(model.config))
        want = (m.num_layers, m.num_experts, m.top_k)
        if have != want:
            raise TraceReplayError(
                f"the trace routes {want[0]} MoE layers x {want[1]} experts, top-{want[2]}, but the model has"
                f" {have[0]} x {have[1]}, top-{have[2]}; build the synthetic shape with the trace's geometry"
            )
        self.trace = trace
        self.cursor = start_step
        self.enabled = True
        self.steps = 0
        self.forced_layers = 0
        self.speculative_forced = 0
        self.speculative_unrecorded = 0
        self._step = None
        self._ids = self._log_probs = self._spec = None  # the current step's tensors, on the device
        self._active_layer: int | None = None  # a router whose experts have not run yet this step
        self._calls: list[tuple[str, int, int]] = []  # ("real" | "spec", layer, distance), LIFO
        self._handles = [model.get_input_embeddings().register_forward_pre_hook(self._begin_step)]
        for ordinal, (_, mlp) in enumerate(layers):
            router = getattr(mlp, adapter.router_attr)
            self._handles.append(router.register_forward_pre_hook(self._enter_router(ordinal)))
            # prepended: policies' own router hooks (registered earlier) must observe the forced output
            self._handles.append(router.register_forward_hook(self._replace_output, prepend=True))
            self._handles.append(mlp.experts.register_forward_pre_hook(self._router_done))

    # -- hooks ----------------------------------------------------------------------------------------
    def _begin_step(self, module, args) -> None:
        self._active_layer = None
        self._calls.clear()
        if not self.enabled:
            self._step = None
            return
        if self.cursor >= len(self.trace):
            raise TraceReplayError(
                f"the trace has {len(self.trace)} steps and all were replayed; run fewer requests"
            )
        step = self.trace.step(self.cursor)
        self._step = step
        self.cursor += 1
        self.steps += 1
        # one copy per step of everything the routers of this step may be given (not one per layer)
        device = args[0].device
        self._ids = step.topk_ids.to(device)  # (T, L, k)
        self._log_probs = step.gate_probs.clamp_min(1e-9).log().to(device)  # (L, J)
        self._spec = step.spec_topk.to(device) if step.spec_topk is not None else None  # (T, D, L, k)

    def _enter_router(self, ordinal: int):
        def pre_hook(module, args) -> None:
            if self._active_layer is None:
                self._active_layer = ordinal
                self._calls.append(("real", ordinal, 0))
            else:  # called from inside router `_active_layer`'s hooks: a speculative look-ahead
                self._calls.append(("spec", self._active_layer, ordinal - self._active_layer))

        return pre_hook

    def _router_done(self, module, args) -> None:
        self._active_layer = None

    def _replace_output(self, module, inputs, output):
        kind, layer, distance = self._calls.pop() if self._calls else ("real", 0, 0)
        step = self._step
        if step is None:
            return None
        logits, weights, ids = output
        tokens = ids.reshape(-1, ids.shape[-1]).shape[0]
        if tokens != step.num_tokens:
            raise TraceReplayError(
                f"trace step {step.index} ({step.kind}) has {step.num_tokens} tokens but the model forward has"
                f" {tokens}; replay needs batch 1 and prompts of the trace's prefill lengths"
            )
        if kind == "spec":
            if step.spec(layer, distance) is None:  # distance not recorded, or past the last layer
                self.speculative_unrecorded += 1
                return None
            forced = self._spec[:, step.spec_distances.index(distance), layer]
            self.speculative_forced += 1
            gate_layer = layer + distance
        else:
            forced = self._ids[:, layer]
            self.forced_layers += 1
            gate_layer = layer
        forced = forced.to(device=ids.device, dtype=ids.dtype).reshape(ids.shape)
        log_probs = self._log_probs[gate_layer].to(device=logits.device, dtype=logits.dtype)
        new_logits = log_probs.expand(tokens, -1).reshape(logits.shape)
        live = torch.softmax(logits.detach().float().reshape(tokens, -1), dim=-1)
        picked = live.gather(1, forced.reshape(tokens, -1).long())
        new_weights = (picked / picked.sum(dim=-1, keepdim=True).clamp_min(1e-20)).to(weights.dtype)
        return new_logits, new_weights.reshape(weights.shape), forced

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def stats(self) -> dict:
        return {
            "steps_replayed": self.steps,
            "router_calls_forced": self.forced_layers,
            "speculative_forced": self.speculative_forced,
            "speculative_unrecorded": self.speculative_unrecorded,
        }


def trace_requests(trace: Trace, vocab_size: int, *, seed: int = 0) -> tuple[list[BenchRequest], Trace]:
    """One batch-1 request per traced request, and the trace reordered so that its steps follow them.

    A request's prompt has its prefill step's length (the prompt recorded for its request id, see
    `recorded_prompts`, when the trace has it and it fits the vocabulary; random ids otherwise); its
    output length is its number of steps (the prefill yields the first token, each decode step one more).
    """
    order = trace.requests()
    if -1 in order:
        raise TraceReplayError(
            "the trace has batched steps (request id -1); replay needs a batch-1 recording"
        )
    ordered = trace.select_requests(order)
    recorded = recorded_prompts(trace)
    rng = random.Random(seed)
    requests, s = [], 0
    kinds = ordered.step_kinds.tolist()
    rids = ordered.request_ids.tolist()
    offsets = ordered.token_offsets.tolist()
    for rid in order:
        first = s
        while s < len(rids) and rids[s] == rid:
            s += 1
        if kinds[first] != STEP_PREFILL or any(k == STEP_PREFILL for k in kinds[first + 1 : s]):
            raise TraceReplayError(f"request {rid} of the trace is not one prefill followed by decode steps")
        prompt_len = offsets[first + 1] - offsets[first]
        prompt = None
        ids = recorded.get(rid)
        if ids is not None and len(ids) == prompt_len and all(0 <= t < vocab_size for t in ids):
            prompt = [int(t) for t in ids]
        if prompt is None:
            prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(tuple(prompt), s - first, 0.0))
    return requests, ordered


def recorded_prompts(trace: Trace) -> dict[int, list[int]]:
    """Request id -> the prompt ids recorded for it. A recording stores its prompts in recording order
    (`meta.extra["prompt_ids"]`) with the request id of each (`"prompt_request_ids"`); a trace from
    before those ids were stored numbered its requests from 0."""
    extra = trace.meta.extra if isinstance(trace.meta.extra, dict) else {}
    prompts = extra.get("prompt_ids") or []
    request_ids = extra.get("prompt_request_ids") or range(len(prompts))
    return {int(r): list(p) for r, p in zip(request_ids, prompts, strict=False)}


def record_heldout_trace(
    model_path: str | Path,
    out_path: str | Path,
    *,
    num_prompts: int = 32,
    output_len: int = 64,
    max_input_len: int = 256,
    spec_distances: tuple[int, ...] = (1, 2, 3, 4),
    skip: int = 0,
    prompts_file: str | Path | None = None,
) -> Trace:
    """Record routing of held-out ShareGPT prompts (or of `prompts_file`'s) on `model_path` (fp32, CPU)
    and save it.

    Prefill = the chat-templated first user turn (at most `max_input_len` tokens); decode steps feed
    the reference reply (teacher forcing, at most `output_len` steps), so they route real text rather
    than a small model's greedy loops. Prompts from `prompts_file` (one per line, or JSONL with
    "prompt"; cycled to `num_prompts`) have no reference reply: the model decodes greedily. The
    prompts' ids are stored in `meta.extra["prompt_ids"]` so a replay can feed the same prefill tokens.
    """
    from transformers import AutoModelForCausalLM

    from ..models.checkpoint import load_tokenizer
    from ..models.registry import get_adapter
    from ..analysis.trace import record_trace
    from ..analysis.workload import encode_requests, heldout_conversations
    from .workload import text_prompts

    tokenizer = load_tokenizer(model_path)
    if prompts_file is not None:
        prompts = text_prompts(tokenizer, num_prompts, max_input_len, str(prompts_file))
        replies, extra, source = None, {"prompts_file": str(prompts_file)}, f"{prompts_file} (greedy)"
    else:
        convs = heldout_conversations(num_prompts + skip)[skip:]
        prompts, replies, conv_ids = encode_requests(
            tokenizer, convs, prompt_tokens=max_input_len, reply_tokens=output_len
        )
        extra, source = {"conversation_ids": conv_ids}, "held-out ShareGPT (teacher-forced)"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # batch-1 steps on the CPU: the per-expert loop is fastest
    trace = record_trace(
        model,
        get_adapter(model.config.model_type),
        prompts,
        output_len,
        spec_distances=spec_distances,
        eos_token_id=tokenizer.eos_token_id,
        source=f"{model_path} {source}",
        continuations=replies,
    )
    trace = Trace(
        dataclasses.replace(trace.meta, extra={**trace.meta.extra, **extra}),
        trace.request_ids,
        trace.step_kinds,
        trace.token_offsets,
        trace.embeddings,
        trace.gate_probs,
        trace.topk_ids,
        trace.spec_topk,
    )
    trace.save(out_path)
    return trace
