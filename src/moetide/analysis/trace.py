"""Routing traces: what every step of a run routed where, recorded once, replayed by the simulator.

A trace is one file per run (safetensors; the header's metadata carries `TraceMeta` as JSON). With S
steps, N tokens over all steps, L MoE layers, J experts, top-k, hidden size H and D speculative
distances, its tensors are:

    request_ids    (S,)          int64    request of the step (-1: several requests batched together)
    step_kinds     (S,)          uint8    0 = prefill, 1 = decode
    token_offsets  (S + 1,)      int64    tokens of step s are rows token_offsets[s]:token_offsets[s+1]
    embeddings     (S, H)        float16  mean over the step's tokens of the embedding-layer output
    gate_probs     (S, L, J)     float16  mean over the step's tokens of softmax(router logits) (fp32)
    topk_ids       (N, L, k)     int16    the experts the router picked for each token at each layer
    spec_topk      (N, D, L, k)  int16    the top-k that router l+d picks from layer l's router input,
                                          d = meta.spec_distances[i]; -1 where l + d >= L (optional)

Step = one forward pass: the prefill of a prompt is one step, each decoded token is one step.
`TraceRecorder` builds a trace from any run (it is an `ExpertPolicy`, so it attaches to the engine like
any policy); `record_trace` records from a plain transformers model with forward hooks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..policies.base import PolicyBase

STEP_PREFILL = 0
STEP_DECODE = 1
_KIND_NAMES = {STEP_PREFILL: "prefill", STEP_DECODE: "decode"}
TRACE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TraceMeta:
    """Geometry and provenance of a trace."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    spec_distances: tuple[int, ...] = ()
    model_type: str = ""
    moe_layer_ids: tuple[int, ...] = ()  # model layer index of each MoE ordinal
    source: str = ""
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d["format_version"] = TRACE_FORMAT_VERSION
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> TraceMeta:
        d = json.loads(text)
        version = d.pop("format_version", None)
        if version != TRACE_FORMAT_VERSION:
            raise ValueError(f"unsupported trace format version {version}; expected {TRACE_FORMAT_VERSION}")
        d["spec_distances"] = tuple(d.get("spec_distances", ()))
        d["moe_layer_ids"] = tuple(d.get("moe_layer_ids", ()))
        return cls(**d)


@dataclass(frozen=True)
class TraceStep:
    """One step of a trace, in compute dtypes.

    embedding (H,) float32; gate_probs (L, J) float32; topk_ids (T, L, k) int64;
    spec_topk (T, D, L, k) int64 or None.
    """

    index: int
    request_id: int
    kind: str
    embedding: torch.Tensor
    gate_probs: torch.Tensor
    topk_ids: torch.Tensor
    spec_topk: torch.Tensor | None
    spec_distances: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    def layer_topk(self, layer: int) -> torch.Tensor:
        """(T, k) int64: the experts each token of the step picked at `layer`."""
        return self.topk_ids[:, layer]

    def spec(self, layer: int, distance: int) -> torch.Tensor | None:
        """(T, k) int64: router layer+distance applied at `layer`; None if not recorded or out of range."""
        if self.spec_topk is None or distance not in self.spec_distances:
            return None
        if layer + distance >= self.gate_probs.shape[0]:
            return None
        return self.spec_topk[:, self.spec_distances.index(distance), layer]


class Trace:
    """A recorded run: see the module docstring for the tensors and their shapes."""

    def __init__(
        self,
        meta: TraceMeta,
        request_ids: torch.Tensor,
        step_kinds: torch.Tensor,
        token_offsets: torch.Tensor,
        embeddings: torch.Tensor,
        gate_probs: torch.Tensor,
        topk_ids: torch.Tensor,
        spec_topk: torch.Tensor | None = None,
    ):
        S = request_ids.shape[0]
        L, J, k, H = meta.num_layers, meta.num_experts, meta.top_k, meta.hidden_size
        if step_kinds.shape != (S,) or token_offsets.shape != (S + 1,):
            raise ValueError("step_kinds must be (S,) and token_offsets (S + 1,)")
        if embeddings.shape != (S, H) or gate_probs.shape != (S, L, J):
            raise ValueError(f"embeddings must be {(S, H)} and gate_probs {(S, L, J)}")
        N = int(token_offsets[-1]) if S else 0
        if topk_ids.shape != (N, L, k):
            raise ValueError(f"topk_ids must be {(N, L, k)}, got {tuple(topk_ids.shape)}")
        D = len(meta.spec_distances)
        if spec_topk is not None and spec_topk.shape != (N, D, L, k):
            raise ValueError(f"spec_topk must be {(N, D, L, k)}, got {tuple(spec_topk.shape)}")
        self.meta = meta
        self.request_ids = request_ids.to(torch.int64)
        self.step_kinds = step_kinds.to(torch.uint8)
        self.token_offsets = token_offsets.to(torch.int64)
        self.embeddings = embeddings.to(torch.float16)
        self.gate_probs = gate_probs.to(torch.float16)
        self.topk_ids = topk_ids.to(torch.int16)
        self.spec_topk = spec_topk.to(torch.int16) if spec_topk is not None else None

    # -- access --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.request_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.token_offsets[-1]) if len(self) else 0

    def step(self, s: int) -> TraceStep:
        a, b = int(self.token_offsets[s]), int(self.token_offsets[s + 1])
        return TraceStep(
            index=s,
            request_id=int(self.request_ids[s]),
            kind=_KIND_NAMES[int(self.step_kinds[s])],
            embedding=self.embeddings[s].float(),
            gate_probs=self.gate_probs[s].float(),
            topk_ids=self.topk_ids[a:b].long(),
            spec_topk=self.spec_topk[a:b].long() if self.spec_topk is not None else None,
            spec_distances=self.meta.spec_distances,
        )

    def __iter__(self) -> Iterator[TraceStep]:
        for s in range(len(self)):
            yield self.step(s)

    def requests(self) -> list[int]:
        """Request ids in order of first appearance."""
        seen: dict[int, None] = {}
        for r in self.request_ids.tolist():
            seen.setdefault(r, None)
        return list(seen)

    def select_steps(self, steps: Sequence[int] | torch.Tensor) -> Trace:
        """A new trace made of the given steps, in the given order."""
        steps = torch.as_tensor(steps, dtype=torch.int64)
        counts = self.token_offsets[1:] - self.token_offsets[:-1]
        token_rows = [
            torch.arange(int(self.token_offsets[s]), int(self.token_offsets[s + 1])) for s in steps.tolist()
        ]
        rows = torch.cat(token_rows) if token_rows else torch.zeros(0, dtype=torch.int64)
        offsets = torch.zeros(len(steps) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(counts[steps], 0) if len(steps) else offsets[1:]
        return Trace(
            self.meta,
            self.request_ids[steps],
            self.step_kinds[steps],
            offsets,
            self.embeddings[steps],
            self.gate_probs[steps],
            self.topk_ids[rows],
            self.spec_topk[rows] if self.spec_topk is not None else None,
        )

    def select_requests(self, request_ids: Sequence[int]) -> Trace:
        """The steps of these requests, requests in the given order, steps in trace order."""
        order = []
        by_request: dict[int, list[int]] = {}
        for s, r in enumerate(self.request_ids.tolist()):
            by_request.setdefault(r, []).append(s)
        for r in request_ids:
            order.extend(by_request.get(int(r), []))
        return self.select_steps(order)

    @staticmethod
    def concat(traces: Sequence[Trace]) -> Trace:
        """Steps of all traces one after the other (same geometry required)."""
        if not traces:
            raise ValueError("concat needs at least one trace")
        m0 = traces[0].meta
        for t in traces[1:]:
            m = t.meta
            if (m.num_layers, m.num_experts, m.top_k, m.hidden_size, m.spec_distances) != (
                m0.num_layers,
                m0.num_experts,
                m0.top_k,
                m0.hidden_size,
                m0.spec_distances,
            ):
                raise ValueError("traces of different geometry cannot be concatenated")
        have_spec = all(t.spec_topk is not None for t in traces)
        offsets = [torch.zeros(1, dtype=torch.int64)]
        base = 0
        for t in traces:
            offsets.append(t.token_offsets[1:] + base)
            base += t.num_tokens
        return Trace(
            m0,
            torch.cat([t.request_ids for t in traces]),
            torch.cat([t.step_kinds for t in traces]),
            torch.cat(offsets),
            torch.cat([t.embeddings for t in traces]),
            torch.cat([t.gate_probs for t in traces]),
            torch.cat([t.topk_ids for t in traces]),
            torch.cat([t.spec_topk for t in traces]) if have_spec else None,
        )

    # -- files ---------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "request_ids": self.request_ids,
            "step_kinds": self.step_kinds,
            "token_offsets": self.token_offsets,
            "embeddings": self.embeddings,
            "gate_probs": self.gate_probs,
            "topk_ids": self.topk_ids,
        }
        if self.spec_topk is not None:
            tensors["spec_topk"] = self.spec_topk
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(path),
            metadata={"moetide_trace": self.meta.to_json()},
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if "moetide_trace" not in header:
                raise ValueError(f"{path} is not a moetide trace (no 'moetide_trace' metadata)")
            meta = TraceMeta.from_json(header["moetide_trace"])
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has keys(), not __iter__
        return cls(
            meta,
            t["request_ids"],
            t["step_kinds"],
            t["token_offsets"],
            t["embeddings"],
            t["gate_probs"],
            t["topk_ids"],
            t.get("spec_topk"),
        )

    def __repr__(self) -> str:
        m = self.meta
        return (
            f"Trace(steps={len(self)}, tokens={self.num_tokens}, requests={len(self.requests())}, "
            f"L={m.num_layers}, J={m.num_experts}, k={m.top_k}, H={m.hidden_size}, spec={m.spec_distances})"
        )


class TraceRecorder(PolicyBase):
    """An `ExpertPolicy` that records every step it observes; `trace()` returns the recording.

    Attach it to the live engine like any policy, or drive it with `PolicyHooks` on a plain model.
    It issues no requests. A step's request id is the single id in `request_ids`, -1 when several
    requests share the step; when the caller passes none, every multi-token step starts a new request.
    """

    name = "trace"

    def __init__(
        self,
        spec_distances: Sequence[int] = (),
        *,
        model_type: str = "",
        moe_layer_ids=(),
        source: str = "",
        extra: dict | None = None,
    ):
        self.speculative_distances = tuple(int(d) for d in spec_distances)
        self.extra = dict(extra or {})
        self._model_type = model_type
        self._moe_layer_ids = tuple(moe_layer_ids)
        self._source = source
        self._steps: list[tuple] = []
        self._cur: dict | None = None
        self._auto_request = -1
        self.incomplete_steps = 0

    def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()) -> None:
        if len(request_ids) == 1:
            rid = int(request_ids[0])
        elif len(request_ids) > 1:
            rid = -1
        else:
            if num_tokens > 1 or self._auto_request < 0:
                self._auto_request += 1
            rid = self._auto_request
        n_req = max(len(request_ids), 1)
        kind = STEP_PREFILL if num_tokens > n_req else STEP_DECODE
        self._cur = {
            "iteration": iteration,
            "request": rid,
            "kind": kind,
            "embedding": embedding.detach().float().reshape(-1).cpu(),
            "probs": {},
            "ids": {},
            "spec": {},
        }

    def observe_layer(self, iteration, layer, gate_probs, topk_ids) -> None:
        if self._cur is None or self._cur["iteration"] != iteration:
            return
        self._cur["probs"][layer] = gate_probs.detach().float().reshape(-1).cpu()
        self._cur["ids"][layer] = topk_ids.detach().reshape(-1, topk_ids.shape[-1]).cpu()

    def observe_speculative(self, iteration, layer, distance, topk_ids) -> None:
        if self._cur is None or self._cur["iteration"] != iteration:
            return
        self._cur["spec"][(layer, distance)] = topk_ids.detach().reshape(-1, topk_ids.shape[-1]).cpu()

    def end_iteration(self, iteration) -> None:
        cur, self._cur = self._cur, None
        if cur is None or cur["iteration"] != iteration:
            return
        L = self.num_layers
        if sorted(cur["ids"]) != list(range(L)):
            self.incomplete_steps += 1
            return
        probs = torch.stack([cur["probs"][l] for l in range(L)])  # (L, J)
        ids = torch.stack([cur["ids"][l] for l in range(L)], dim=1)  # (T, L, k)
        spec = None
        if self.speculative_distances:
            T, k = ids.shape[0], ids.shape[2]
            spec = torch.full((T, len(self.speculative_distances), L, k), -1, dtype=torch.int64)
            for (l, d), v in cur["spec"].items():
                if d in self.speculative_distances:
                    spec[:, self.speculative_distances.index(d), l] = v
        self._steps.append((cur["request"], cur["kind"], cur["embedding"], probs, ids, spec))

    def __len__(self) -> int:
        return len(self._steps)

    def trace(self) -> Trace:
        """The steps recorded so far as a `Trace`."""
        if not self._steps:
            raise ValueError("no complete step was recorded")
        H = self._steps[0][2].shape[0]
        meta = TraceMeta(
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=H,
            spec_distances=self.speculative_distances,
            model_type=self._model_type,
            moe_layer_ids=self._moe_layer_ids,
            source=self._source,
            extra=self.extra,
        )
        counts = torch.tensor([s[4].shape[0] for s in self._steps], dtype=torch.int64)
        offsets = torch.zeros(len(self._steps) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(counts, 0)
        return Trace(
            meta,
            torch.tensor([s[0] for s in self._steps], dtype=torch.int64),
            torch.tensor([s[1] for s in self._steps], dtype=torch.uint8),
            offsets,
            torch.stack([s[2] for s in self._steps]),
            torch.stack([s[3] for s in self._steps]),
            torch.cat([s[4] for s in self._steps]),
            torch.cat([s[5] for s in self._steps]) if self.speculative_distances else None,
        )


def record_trace(
    hf_model,
    adapter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    spec_distances: Sequence[int] = (1, 2, 3, 4),
    eos_token_id: int | None = None,
    request_id_start: int = 0,
    source: str = "",
    continuations: Sequence[Sequence[int]] | None = None,
) -> Trace:
    """Record a trace from a plain transformers MoE model by greedy decoding each prompt.

    `prompts`: token-id lists, one request each (decoded one after the other, batch 1). Each request
    is one prefill step plus up to `max_new_tokens - 1` decode steps (the last generated token needs
    no forward). `continuations`: teacher forcing, see `greedy_generate` (e.g. the reference reply,
    so that decode steps route real text rather than a small model's greedy loops).
    The prompts' ids are kept in `meta.extra["prompt_ids"]` (recording order), the request id of each
    in `meta.extra["prompt_request_ids"]` (`request_id_start + i`).
    Routers are observed with forward hooks (`PolicyHooks`); nothing is patched.
    """
    from ..policies.hooks import PolicyHooks

    recorder = TraceRecorder(
        spec_distances,
        model_type=getattr(hf_model.config, "model_type", ""),
        source=source,
        extra={
            "prompt_ids": [[int(t) for t in p] for p in prompts],
            "prompt_request_ids": [request_id_start + i for i in range(len(prompts))],
        },
    )
    hooks = PolicyHooks(hf_model, adapter, [recorder])
    recorder._moe_layer_ids = tuple(hooks.moe_layer_ids)
    try:
        greedy_generate(
            hf_model,
            prompts,
            max_new_tokens,
            hooks=hooks,
            eos_token_id=eos_token_id,
            request_id_start=request_id_start,
            continuations=continuations,
        )
    finally:
        hooks.remove()
    return recorder.trace()


@dataclass
class GenerationResult:
    """Greedy outputs per request and wall time of every forward step (seconds)."""

    tokens: list[list[int]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)


@torch.no_grad()
def greedy_generate(
    hf_model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    hooks: PolicyHooks | None = None,
    eos_token_id: int | None = None,
    request_id_start: int = 0,
    continuations: Sequence[Sequence[int]] | None = None,
) -> GenerationResult:
    """Greedy decoding, batch 1, with a `DynamicCache`: one forward for the prefill, one per new token.

    `hooks.request_ids` is set to the current request before its first forward. With
    `continuations` (teacher forcing), request r feeds `continuations[r][i]` as its i-th new token
    instead of the greedy one and ends when they run out. `tokens` are always the model's greedy
    predictions.
    """
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = next(hf_model.parameters()).device
    # router logits are observed by hooks; asking the model for them would add its aux-loss work
    extra = {"output_router_logits": False} if hasattr(hf_model.config, "output_router_logits") else {}
    result = GenerationResult()
    for r, prompt in enumerate(prompts):
        if hooks is not None:
            hooks.request_ids = (request_id_start + r,)
        cache = DynamicCache(config=hf_model.config)
        x = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        out_tokens: list[int] = []
        for step in range(max_new_tokens):
            t0 = time.perf_counter()
            out = hf_model(input_ids=x, past_key_values=cache, use_cache=True, **extra)
            nxt = int(out.logits[0, -1].argmax())  # NOTE: host sync (a greedy token is needed on the host)
            result.step_times_s.append(time.perf_counter() - t0)
            out_tokens.append(nxt)
            if continuations is not None:
                if step >= len(continuations[r]):
                    break
                fed = int(continuations[r][step])
            else:
                fed = nxt
            if (eos_token_id is not None and fed == eos_token_id) or step == max_new_tokens - 1:
                break
            x = torch.tensor([[fed]], dtype=torch.long, device=device)
        result.tokens.append(out_tokens)
    return result
