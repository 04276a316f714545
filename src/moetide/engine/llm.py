"""The Python API, in the shape users know from vLLM: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import EngineConfig, format_bytes, parse_bytes
from ..errors import ConfigError
from ..models.checkpoint import inspect_checkpoint, load_tokenizer
from ..models.loader import LoadedModel, resolve_device
from ..progress import on_terminal
from ..residency import KV_BLOCK_SIZE, MAX_PREFILL_TOKENS, kv_pool_blocks
from .assemble import load_model
from .chat import ChatEncoder
from .kv_blocks import BlockAllocator
from .llm_engine import PREFILL_CHUNK_TOKENS, LLMEngine
from .memory import resolve_budget
from .paged_cache import PagedKVCache, decode_kernel_supported, use_decode_kernel
from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence


def demo_model_path() -> Path:
    """The embedded demo model shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "demo_model"


@dataclass
class RequestOutput:
    """One finished request: text, tokens and timings (seconds)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    ttft_s: float | None
    tpot_s: float | None

    @classmethod
    def from_sequence(cls, seq: Sequence, prompt: str | None) -> RequestOutput:
        return cls(
            seq.request_id,
            prompt,
            seq.prompt_ids,
            list(seq.output_ids),
            seq.text,
            seq.finish_reason,
            seq.ttft_s,
            seq.tpot_s,
        )


def kv_cache_tokens(config: EngineConfig, loaded: LoadedModel) -> int | None:
    """The KV reservation the memory plan made (admission control), or the config's, or no limit."""
    plan = loaded.runtime.residency.plan
    return plan.fixed.kv_cache_tokens if plan is not None else config.kv_cache_tokens


def attach_policy(config: EngineConfig, loaded: LoadedModel) -> None:
    """Build the policy object for `config.policy` and hook it to the model and the residency core.

    Residency-only policies (on-demand, static-*, no-offload) need no object: the memory mode is the
    policy. dynaexq gets every hi slot for its hot set (and every slot of a deeper ladder's middle
    tiers for theirs); combined gives half of each to DynaExq and leaves half to FineMoE's
    prefetches. Neither is attached when the whole model fits in hi, with no cap or under one (the
    residency's "all-hi" mode): then decode steps can be CUDA graphs.
    """
    from ..policies import make_policy
    from ..policies.dynaexq import per_layer_hi_slots
    from ..policies.hooks import PolicyHooks
    from ..policies.registry import DETERMINISTIC_UPDATE_STEPS, policy_spec, step_clock

    spec = policy_spec(config.policy)
    residency = loaded.runtime.residency
    options = residency.options
    if not spec.predicts or options is None:
        return
    if options.mode == "all-hi":
        return  # every expert fits in hi: nothing to prefetch or requantize
    layers = len(loaded.moe_layers)
    experts = loaded.store.num_experts
    # DynaExq's hot set gets its share of the hi slots (PolicySpec.hi_share), spread over the layers
    n_hi, n_mid = None, ()
    if spec.hi_share is not None:
        n_hi, *n_mid = (
            per_layer_hi_slots(int(slots * spec.hi_share), layers, experts)
            for slots in residency.plan.upper_slots
        )
    # --deterministic: searches inline, DynaExq's updates every DETERMINISTIC_UPDATE_STEPS steps
    timing = {"synchronous": True, "clock": step_clock(), "update_interval_s": DETERMINISTIC_UPDATE_STEPS}
    from ..residency.core import TABLE_LAG

    # policies that predict within a step see each layer as it runs (the layer feed); the rest, and
    # every policy under --deterministic, see each step one step late (compute/observations.py)
    in_step = spec.in_step and config.layer_feed and not config.deterministic
    policy = make_policy(
        config.policy,
        lookahead=0 if in_step else TABLE_LAG,
        prefetch_distance=config.prefetch_distance,
        n_hi=n_hi,
        n_mid=tuple(n_mid),
        map_store_path=config.map_store,
        searcher=config.searcher,
        **(timing if config.deterministic else {}),
    )
    loaded.policy = policy
    scheduler = getattr(policy, "precision_policy", policy)
    if hasattr(scheduler, "set_promotion_gain"):  # DynaExq ranks experts by selections x what promotion buys
        scheduler.set_promotion_gain(loaded.store.promotion_gain(options.hi_precision, options.lo_precision))
    loaded.policy_hooks = PolicyHooks(
        loaded.model, loaded.adapter, [policy], sink=residency, runtime=loaded.runtime, in_step=in_step
    )


def save_map_store(config: EngineConfig, loaded: LoadedModel) -> Path | None:
    """Write FineMoE's expert-map store (finemoe, combined; with its online inserts) to
    `config.map_store`. Returns the path, or None where no path is set or there is no store."""
    if not config.map_store or loaded.policy is None:
        return None
    finemoe = getattr(loaded.policy, "prefetch_policy", loaded.policy)
    if not hasattr(finemoe, "save_store"):
        return None
    try:
        finemoe.save_store(config.map_store)
    except ValueError:  # nothing observed yet: no store to write
        return None
    return Path(config.map_store)


def context_length(config: EngineConfig, model_config) -> int:
    """Tokens of context a sequence gets (prompt + output): the config's cap within the model's."""
    model_len = getattr(model_config, "max_position_embeddings", None) or 4096
    return min(config.max_model_len or model_len, model_len)


def quiet_tokenizer(tokenizer):
    """The tokenizer without transformers' one-time "sequence length is longer than the specified
    maximum" warning: the engine checks prompts against the context and says so itself."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def progress_bars(progress: bool, what: str) -> bool:
    """Progress bars only on a terminal; elsewhere (a log file, a pipe) one plain line on stderr."""
    if not progress:
        return False
    if on_terminal():
        return True
    print(f"[moetide] {what}", file=sys.stderr, flush=True)
    return False


def host_plan(config: EngineConfig, device) -> tuple[bool, object, str]:
    """`(map_hi, the host BudgetTracker, the caps in words)`: the host cap checked before the load."""
    from ..store.tracker import BudgetTracker
    from .host_memory import check_host_budget, host_cap

    map_hi = check_host_budget(config, device.type)
    tracker = BudgetTracker(host_cap(config))
    cap = "no cap" if config.gpu_memory_bytes is None else f"cap {format_bytes(config.gpu_memory_bytes)}"
    if map_hi:
        cap += f", host cap {format_bytes(tracker.total_bytes)}: hi read from the mapped checkpoint"
    return map_hi, tracker, cap


def build_engine(config: EngineConfig, *, progress: bool = True) -> tuple[LoadedModel, LLMEngine, object]:
    """Load the checkpoint and wire model, residency, runner and engine from one config.

    The budget is checked against the model built on the meta device before any weight is read.
    `progress`: bars while loading on a terminal, one line otherwise.
    """
    from ..compute.fused_moe_config import moe_scratch_bytes
    from ..compute.runtime import check_lo_kernel
    from ..residency import build_residency
    from .memory import check_budget

    inspect_checkpoint(config.model_path)  # a bad path is reported before the tokenizer is looked for
    tokenizer = quiet_tokenizer(load_tokenizer(config.model_path))
    device = resolve_device(config.device)
    check_lo_kernel(config.lo_kernel, device)  # before the weights load
    check_budget(config)
    map_hi, host_budget, cap = host_plan(config, device)
    what = f"loading {config.model_path.name} on {device} ({config.policy}, {cap})"
    progress = progress_bars(progress, what)
    loaded = load_model(
        config.model_path,
        device=device,
        dtype=config.dtype,
        residency_factory=lambda store, metrics, dev, model, model_config: build_residency(
            config,
            store,
            metrics,
            dev,
            model,
            model_config,
            progress=progress,
            moe_scratch_bytes=moe_scratch_bytes(
                model_config, store.bytes_per_expert("hi"), MAX_PREFILL_TOKENS
            ),
        ),
        progress=progress,
        host_budget=host_budget,
        map_hi=map_hi,
    )
    loaded.runtime.metrics.host_store = loaded.store
    loaded.runtime.set_lo_kernel(config.lo_kernel, device)
    loaded.runtime.observations.decode_tokens = max(config.max_num_seqs, 1)  # before any step
    attach_policy(config, loaded)
    max_model_len = context_length(config, loaded.config)
    eos = set()
    for source in (tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(int(x) for x in source)
    kv_tokens = kv_cache_tokens(config, loaded)
    blocks, kv = paged_kv(config, loaded, kv_tokens, max_model_len)
    if decode_attention_kernel(config, loaded):
        use_decode_kernel(loaded.model, kv)
    # a layer feed follows each step as it runs and drops what arrives for a step not the latest begun:
    # its policies keep reading each step's tokens before the next starts (EngineConfig.decode_ahead)
    feed = loaded.policy_hooks.feed if loaded.policy_hooks is not None else None
    engine = LLMEngine(
        ModelRunner(
            loaded.model,
            loaded.device,
            kv,
            graphs=graphed_decoder(config, loaded, kv, max_model_len),
            runtime=loaded.runtime,
            max_rows=config.max_num_seqs,
        ),
        tokenizer,
        eos,
        blocks,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        kv_cache_tokens=kv_tokens,
        prefill_chunk_tokens=min(PREFILL_CHUNK_TOKENS, MAX_PREFILL_TOKENS),
        decode_ahead=config.decode_ahead == "auto" and feed is None and not config.deterministic,
    )
    return loaded, engine, tokenizer


def paged_kv(
    config: EngineConfig, loaded: LoadedModel, kv_tokens: int | None, max_model_len: int
) -> tuple[BlockAllocator, PagedKVCache]:
    """The paged KV cache: as many blocks as the memory plan's KV reservation holds (its pad block
    is reserved on top), or, with no plan (the CPU without a budget), `max_num_seqs` full-length
    sequences' worth, allocated as it is first used."""
    tokens = kv_tokens if kv_tokens is not None else config.max_num_seqs * max_model_len
    num_blocks = kv_pool_blocks(tokens)
    grow = loaded.device.type == "cpu"
    return (
        BlockAllocator(num_blocks, block_size=KV_BLOCK_SIZE, prefix_caching=config.prefix_caching),
        PagedKVCache(num_blocks, KV_BLOCK_SIZE, loaded.device, grow=grow),
    )


def decode_attention_kernel(config: EngineConfig, loaded: LoadedModel) -> bool:
    """Whether decode steps attend straight from the paged pools (`EngineConfig.decode_attention`);
    "kernel" where the model's attention does not allow it is an error, "auto" falls back."""
    import importlib.util
    import os

    if config.decode_attention == "gather":
        return False
    supported = decode_kernel_supported(loaded.config)
    runnable = importlib.util.find_spec("triton") is not None and (
        loaded.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    )
    if config.decode_attention == "kernel" and not (supported and runnable):
        why = "this model's attention (sliding window, latent keys or head shape)" if not supported else (
            "no triton, or a CPU without TRITON_INTERPRET=1")  # fmt: skip
        raise ConfigError(f"decode_attention='kernel' cannot run here: {why}; use 'auto' or 'gather'")
    return supported and runnable and (config.decode_attention == "kernel" or loaded.device.type == "cuda")


def graphed_decoder(config: EngineConfig, loaded: LoadedModel, kv: PagedKVCache, max_model_len: int):
    """CUDA-graph decode (engine/graphed_decode.py) on a CUDA device unless `cuda_graphs` is "off";
    it captures only steps whose experts need no host decision, so every policy can have one."""
    from .graphed_decode import GraphedDecoder
    from .runner import ENGINE_SDPA_BACKENDS

    if config.cuda_graphs == "off" or loaded.device.type != "cuda":
        return None
    return GraphedDecoder(
        loaded.model,
        kv,
        loaded.runtime.decode_is_sync_free,
        ENGINE_SDPA_BACKENDS,
        capture=True,
        compile_step=config.compile == "auto",
        max_rows=config.max_num_seqs,  # what the observations' fixed buffer and kernel scratch hold
        max_width=-(-max_model_len // kv.block_size),
    )


class LLM:
    """Offline inference over a local MoE checkpoint with managed experts.

    Example:
        llm = moetide.LLM()                       # the embedded demo model
        out = llm.generate(["Hello"], moetide.SamplingParams(max_tokens=32, temperature=0))
        print(out[0].text)

    `gpu_memory`: a size ("6GiB"), bytes, or "NN%" (the fixed part + NN % of all experts in hi
    precision for this model); a budget too small for the policy is refused before the load.
    `cpu_memory`: a size ("24GiB") or bytes: the cap on host memory for expert versions (default:
    what the machine can spare); below the model's experts, hi is read from the mapped checkpoint.
    Other keyword arguments set `EngineConfig` fields (`lo_kernel`, `prefetch_distance`, `searcher`,
    `cuda_graphs`, ...); a name that is not one is an error.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | None = None,
        gpu_memory: str | int | None = None,
        cpu_memory: str | int | None = None,
        policy: str = "combined",
        dtype: str = "auto",
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        progress: bool = False,
        **extra,
    ):
        unknown = sorted(set(extra) - set(EngineConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(
                f"unknown option(s) for moetide.LLM: {', '.join(unknown)} (the options are EngineConfig's fields)"
            )
        self.config = EngineConfig(
            model=str(model if model is not None else demo_model_path()),
            device=device,
            dtype=dtype,
            policy=policy,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            **extra,
        )
        if cpu_memory is not None:  # "24GiB" or bytes: the host memory for expert versions
            self.config = replace(self.config, cpu_memory_bytes=parse_bytes(cpu_memory))
        if gpu_memory is not None:  # "6GiB", bytes, or "25%" (of this model: see engine/memory.py)
            self.config = replace(self.config, gpu_memory_bytes=resolve_budget(gpu_memory, self.config))
        self.loaded, self.engine, self.tokenizer = build_engine(self.config, progress=progress)

    @property
    def metrics(self):
        return self.loaded.runtime.metrics

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ConfigError("each prompt must be a string or a list of token ids")

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Complete a prompt or a batch of prompts (strings or token-id lists); outputs in input order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ConfigError("give one SamplingParams, or one per prompt")
        seqs = []
        for prompt, p in zip(prompts, params_list, strict=True):
            text, ids = self._encode(prompt)
            seqs.append((text, self.engine.add_request(ids, p)))
        while self.engine.has_unfinished():
            self.engine.step()
        return [RequestOutput.from_sequence(seq, text) for text, seq in seqs]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """One conversation (`[{"role", "content"}]`) -> prompt token ids, as the server encodes it:
        special-token text inside a message's content stays text (engine/chat.py)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"{self.config.model}: the tokenizer has no chat template; use generate() instead"
            )
        return self.chat_encoder.encode(messages)

    @functools.cached_property
    def chat_encoder(self) -> ChatEncoder:
        return ChatEncoder(self.tokenizer)

    def chat(self, messages, sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (list of {role, content}) or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params)

    def close(self) -> None:
        if self.loaded.policy is not None:
            save_map_store(self.config, self.loaded)
            self.loaded.policy.close()
            self.loaded.policy_hooks.remove()
        self.engine.runner.close()
        self.loaded.runtime.residency.close()
        self.loaded.store.close()
