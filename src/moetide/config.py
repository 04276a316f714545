"""Dataclass configs, validated once in `__post_init__`: the one source of truth for every knob.

The CLI and the Python API map their arguments onto these; errors say what to change.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .policies.registry import POLICY_NAMES, policy_spec
from .store.formats import FORMATS, LOW_BIT_FORMATS, ladder_name, parse_ladder, precision_names, user_name
from .units import format_bytes  # noqa: F401 - re-exported

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

POLICIES = POLICY_NAMES  # every --policy name, declared once in policies/registry.py
PRECISIONS = tuple(FORMATS)  # the registry's names: store/formats.py
LO_KERNELS = ("auto", "cuda", "triton", "dequant")
DECODE_ATTENTIONS = ("auto", "kernel", "gather")


def parse_bytes(text: str | float | None) -> int | None:
    """`"6GiB"` -> 6442450944; `"512MB"` -> 512000000; ints pass through; None stays None."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"memory size must be positive, got {text}")
        return int(text)
    if str(text).strip().startswith("-"):
        raise ConfigError(f"memory size must be positive, got {text!r}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {text!r}; write it like 6GiB, 512MiB or 8GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def typed_size(nbytes: int) -> str:
    """A `--gpu-memory` value the user can type that is >= `nbytes`: whole MiB below 10 GiB, else GiB
    with two decimals (rounded up, never down)."""
    if nbytes < 10 << 30:
        return f"{math.ceil(nbytes / (1 << 20))}MiB"
    hundredths = math.ceil(nbytes / (1 << 30) * 100)
    while parse_bytes(f"{hundredths / 100:.2f}GiB") < nbytes:
        hundredths += 1
    return f"{hundredths / 100:.2f}GiB"


CUDA_GRAPHS = ("auto", "off")
ON_MISS = ("auto", "lo", "zero-copy")  # see EngineConfig.on_miss
# what `--gpu-memory NN%` means, in every command (engine.memory.relative_budget computes it)
RELATIVE_BUDGET_HELP = (
    "NN%% = the budget at which what is left after the fixed part (non-expert weights, KV cache,"
    " activations, dequant scratch, as this command reserves them at that budget) holds NN%% of all"
    " experts in hi precision"
)
# The server's floor under the derived KV reservation, per sequence of max_num_seqs: a chat turn (a
# ~50-token ShareGPT prompt, 64 out) fills 8 blocks of 16. Measured (OLMoE shape, combined, 4 GiB,
# 64 streaming clients): 4,096 tokens of KV preempted 20 sequences, TTFT p90 9.2 s,
# 316 tok/s; 8,192 tokens none, 0.93 s, 1,252 tok/s.
SERVE_KV_TOKENS_PER_SEQ = 128
COMPILE_MODES = ("auto", "off")  # torch.compile of the captured decode step (engine/graphed_decode.py)
DECODE_AHEAD = ("auto", "off")  # the next decode step launched before this one's tokens are read
SEARCHERS = ("process", "thread")  # where FineMoE's searcher runs (policies/finemoe.py)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and serve it under a memory budget.

    Attributes:
        model: checkpoint directory (config.json, tokenizer files, *.safetensors).
        device: "cuda", "cuda:N", "cpu" or None for CUDA when available.
        dtype: compute dtype ("auto" = checkpoint dtype on CUDA, float32 on CPU).
        gpu_memory_bytes: hard cap on what moetide allocates on the device; None = no cap.
        cpu_memory_bytes: hard cap on the host memory moetide allocates for expert versions (hi and
            lo arenas, staged hi slots, batches read from the checkpoint to quantize), pinned or not;
            None = what the machine can spare (`engine/host_memory.py`). Below every hi version +
            the lo versions, hi versions are read from the mapped checkpoint (docs/memory.md).
        policy: expert residency policy (see POLICIES).
        lo_precision: the low precision kept for "lo" versions (a low-bit name of `store.formats.FORMATS`:
            "int4", "int2+4", "int2", or "auto": int4 when all experts fit in int4 with room left for
            a hi cache, else int2).
        on_miss: what a step does with an expert that has no device version: "auto" (default: "lo"
            where every lo version is resident — combined, dynaexq — else "zero-copy"), "lo" (run the
            resident lo version), "zero-copy" (the kernel reads the hi version from pinned host
            memory). Neither waits for the host: the expert is copied in for the next steps.
        prefetch_distance: FineMoE's d, in layers.
        max_num_seqs: sequences decoded together at most.
        max_model_len: context length cap (prompt + output), in tokens; None = model's limit.
        kv_cache_tokens: tokens of KV cache reserved inside the budget; None = derived. The paged
            KV cache holds kv_cache_tokens // 16 blocks of 16 tokens.
        kv_tokens_per_seq: where kv_cache_tokens is derived, it holds at least this many tokens for
            each of max_num_seqs sequences, as long as they take at most a quarter of the budget
            (0: no such floor; `moetide serve` asks for SERVE_KV_TOKENS_PER_SEQ).
        prefix_caching: reuse the KV blocks of a request's longest cached prefix (full blocks).
        seed: seed for sampling when a request gives none.
        hi_precision: what "hi" means for dynaexq/combined: "hi" (the checkpoint's precision) or a
            low-bit format with more bytes than `lo_precision` (e.g. "int4" hot over "int2+4" or
            "int2" cold; the lo precision then defaults to "int2").
        ladder: DynaExq's precision ladder for dynaexq/combined, hottest first (a "bf16>int4>int2"
            string or a tuple of `store.formats.FORMATS` names, each taking fewer bytes than the one
            before): every expert keeps its coldest version resident, and each tier above it is a
            pool of the budget's choosing (`residency.budget.split_ladder`) holding the next-hottest
            experts. It sets `hi_precision` (its top) and `lo_precision` (its bottom); None = the
            two-tier ladder `hi_precision > lo_precision`. Other policies ignore it, as they do --hi.
        ladder_slots: the slots of each tier above the coldest (all layers; hi first), in place of the
            budget's split: for tools that name tier sizes themselves (`moetide eval` counts them in
            the bf16 layout, the same on every device). None (default): `split_ladder` decides.
        host_versions: expert versions kept in host memory after start-up ("hi", "lo"); None = all.
            A version can be dropped only where the device holds it for every expert for good.
        lo_kernel: how the experts are computed: "dequant" (per expert, dequantize to the compute
            dtype, then a matmul; any device), "triton" (the fused MoE kernel over the slot table,
            compute/fused_moe.py, its Triton tiles for every pool; needs CUDA and triton), "cuda" (the
            fused kernel, with packed int2 / int4 pools on the tensor-core kernels of
            compute/lo_cuda.py where nvcc can build them for the device, else on the Triton tiles), or
            "auto" (the default: "cuda" on CUDA where the experts are SiLU-gated, else dequant).
        decode_attention: how decode steps attend over the paged KV cache: "kernel" (a Triton kernel
            reads each row's blocks in place, engine/paged_attention.py; needs triton and, on the
            CPU, its interpreter), "gather" (the rows' blocks gathered, then transformers' SDPA), or
            "auto" (the default: the kernel on CUDA where the model's attention allows it, else
            gather; the kernel measured 2-3x faster per layer at 32-64 rows of 512-2,048 tokens).
        cuda_graphs: "auto" (the default: on a CUDA device, decode steps whose experts need no host
            decision, i.e. no-offload, static-int4/int2 and uncapped runs whose experts all fit in hi,
            are captured once per batch shape and replayed; see engine/graphed_decode.py) or "off"
            (every step launched from Python).
        compile: "auto" compiles each captured decode step with torch.compile (Inductor fuses the
            non-expert elementwise work; the MoE layers stay the fused kernel; CUDA only, once per
            batch and column bucket) before capturing it; "off" (the default, see BENCHMARKS.md for
            the measurement) captures the eager step.
        decode_ahead: "auto" (the default) launches a decode step before the host has read the tokens
            of the step before it: the sampled tokens stay on the device and feed the next step, and
            the host reads them (stop checks, text, outputs) while that step runs, so scheduling and
            the graph launch overlap the device's work. It applies while every decoding row samples
            greedily on the device, no prompt is being prefilled or could be admitted, the KV pool
            has a block for every running sequence, no layer feed follows the steps (finemoe, lru
            and moe-infinity keep reading each step as it runs) and not `deterministic`; otherwise
            the step reads its tokens before the next is scheduled. A sequence that stops on a stop
            token or string had one more step run for it, whose token is dropped. "off": every
            step's tokens are read before the next step is scheduled.
        deterministic: residency decisions become a function of the request stream alone: copies are
            published only at step boundaries (each step waits for the copies issued before it),
            FineMoE's searches run inline on the forward thread, and DynaExq updates every
            `DETERMINISTIC_UPDATE_STEPS` steps instead of every T_u seconds. Two identical runs then
            give identical greedy tokens for every policy. Costs the overlap of copies with compute.
        wait_for_copies: a layer that routes to an expert whose hi version is still being copied (a
            prefetch that has not landed) waits for that copy on the device (the MoE kernel spins on
            the slot's landed word, which the copy stream writes after the data) instead of running
            it from host memory or lo: a late prefetch becomes a hit with a stall. No host sync.
            Off by default (a trace replay with FineMoE: hit rate 0.692 against 0.677, 28.8 against
            30.1 tok/s).
        searcher: where FineMoE's map searcher runs (finemoe, combined): "process" (the default: its
            own process, fed through shared memory; the forward thread only copies observations
            in and decisions out) or "thread" (a thread of the engine's process, which shares the
            GIL with the forward thread).
        layer_feed: finemoe, lru and moe-infinity see each MoE layer of the running step as the
            device routes it and prefetch for its later layers within the step (the layer feed,
            policies/in_step.py); False: they decide a step late, from each step's observations, as
            combined and dynaexq do (the form the trace simulator models with `decision_lag=2`).
        map_store: the path of a FineMoE expert-map store (`ExpertMapStore.save`): finemoe and combined
            start from it where the file exists (else from an empty store), and `save_map_store`
            writes the store there (`moetide generate` at its end, `LLM.close`, server shutdown);
            None: an empty store, never written.
        simulated_copy_bytes_per_s: on the CPU only, pace expert copies to this rate (a simulated
            host-to-device link, for tests and trace replays); None: as fast as memory copies.
        poison_slots: on the CPU only, fill a slot with NaN bytes before each copy into it, so that a
            read of a partly written or reused slot cannot go unnoticed (tests).
    """

    model: str
    device: str | None = None
    dtype: str = "auto"
    gpu_memory_bytes: int | None = None
    cpu_memory_bytes: int | None = None
    policy: str = "combined"
    lo_precision: str = "auto"
    on_miss: str = "auto"
    prefetch_distance: int = 2
    max_num_seqs: int = 32
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    kv_tokens_per_seq: int = 0
    seed: int = 0
    hi_precision: str = "hi"
    cache_dir: str | None = None  # where prepared lo versions are read and written (None: next to the model)
    ladder: tuple[str, ...] | None = None
    ladder_slots: tuple[int, ...] | None = None
    host_versions: tuple[str, ...] | None = None
    lo_kernel: str = "auto"
    decode_attention: str = "auto"
    cuda_graphs: str = "auto"
    prefix_caching: bool = True
    compile: str = "off"
    decode_ahead: str = "auto"
    deterministic: bool = False
    wait_for_copies: bool = False
    searcher: str = "process"
    layer_feed: bool = True
    map_store: str | None = None
    simulated_copy_bytes_per_s: float | None = None
    poison_slots: bool = False

    def __post_init__(self) -> None:
        named = self.device not in (None, "", "auto")
        if named and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", str(self.device)):
            raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of: {', '.join(POLICIES)}")
        if self.ladder is not None:
            self._apply_ladder()
        if self.ladder_slots is not None:
            tiers = len(self.ladder or ("hi", "lo")) - 1
            slots = tuple(self.ladder_slots)
            if len(slots) != tiers or any(not isinstance(n, int) or n < 0 for n in slots):
                raise ConfigError(f"ladder_slots needs {tiers} counts >= 0 (hi first), got {slots}")
            object.__setattr__(self, "ladder_slots", slots)
        if self.lo_precision != "auto" and self.lo_precision not in LOW_BIT_FORMATS:
            names = ", ".join(("auto", *LOW_BIT_FORMATS))
            raise ConfigError(f"--lo must be one of {names}, got {self.lo_precision!r}")
        if self.searcher not in SEARCHERS:
            raise ConfigError(f"--searcher must be one of {', '.join(SEARCHERS)}, got {self.searcher!r}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.decode_ahead not in DECODE_AHEAD:
            raise ConfigError(
                f"--decode-ahead must be one of {', '.join(DECODE_AHEAD)}, got {self.decode_ahead!r}"
            )
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ConfigError(
                f"--cuda-graphs must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graphs!r}"
            )
        rate = self.simulated_copy_bytes_per_s
        if rate is not None and not rate > 0:
            raise ConfigError(f"simulated_copy_bytes_per_s must be > 0 (or None), got {rate!r}")
        if self.on_miss not in ON_MISS:
            raise ConfigError(f"--on-miss must be one of {', '.join(ON_MISS)}, got {self.on_miss!r}")
        hi_cache_only = self.policy in POLICY_NAMES and policy_spec(self.policy).memory_mode == "hi-cache"
        if self.on_miss == "lo" and hi_cache_only:
            raise ConfigError(
                f"--on-miss lo needs a policy that keeps a lo version of every expert (combined, dynaexq);"
                f" {self.policy} caches hi versions only: use --on-miss zero-copy"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.prefetch_distance < 1:
            raise ConfigError(f"prefetch distance must be >= 1 layer, got {self.prefetch_distance}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        per_seq = self.kv_tokens_per_seq
        if not isinstance(per_seq, int) or per_seq < 0:
            raise ConfigError(f"kv_tokens_per_seq must be a whole number >= 0, got {per_seq!r}")
        kv_tokens = self.kv_cache_tokens
        if kv_tokens is not None and (not isinstance(kv_tokens, int) or kv_tokens < 1):
            raise ConfigError(f"--kv-cache-tokens must be a whole number of tokens >= 1, got {kv_tokens!r}")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes <= 0:
            raise ConfigError("--gpu-memory must be a positive size such as 6GiB")
        if self.cpu_memory_bytes is not None and self.cpu_memory_bytes <= 0:
            raise ConfigError("--cpu-memory must be a positive size such as 24GiB")
        if not str(self.model):
            raise ConfigError("a model path is required")
        if self.hi_precision not in FORMATS:
            names = ", ".join(("hi", *precision_names()[1:]))
            raise ConfigError(f"hi precision must be one of {names}, got {self.hi_precision!r}")
        if self.hi_precision != "hi" and self.lo_precision != "auto":
            order = list(FORMATS)  # most bytes first
            if order.index(self.lo_precision) <= order.index(self.hi_precision):
                raise ConfigError(
                    f"with {self.hi_precision} hot experts the lo precision must take fewer bytes"
                    f" (one of {', '.join(order[order.index(self.hi_precision) + 1 :])}), got {self.lo_precision}"
                )
        if self.decode_attention not in DECODE_ATTENTIONS:
            names = ", ".join(DECODE_ATTENTIONS)
            raise ConfigError(f"decode_attention must be one of {names}, got {self.decode_attention!r}")
        if self.lo_kernel not in LO_KERNELS:
            raise ConfigError(f"--lo-kernel must be one of {', '.join(LO_KERNELS)}, got {self.lo_kernel!r}")
        if self.host_versions is not None:
            bad = [v for v in self.host_versions if v not in ("hi", "lo")]
            if bad:
                raise ConfigError(f"--host-versions takes hi and/or lo, got {bad[0]!r}")

    def _apply_ladder(self) -> None:
        """Parse `ladder` (ConfigError on a bad one) and set `hi_precision` / `lo_precision` from
        its ends; an explicit --hi or --lo must agree with them."""
        try:
            ladder = parse_ladder(self.ladder)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        top, bottom = ladder[0], ladder[-1]
        if self.hi_precision not in ("hi", top):
            raise ConfigError(
                f"--hi {user_name(self.hi_precision)} disagrees with --ladder {ladder_name(ladder)},"
                f" whose top is {user_name(top)}; give one of them"
            )
        if self.lo_precision not in ("auto", bottom):
            raise ConfigError(
                f"--lo {self.lo_precision} disagrees with --ladder {ladder_name(ladder)}, whose bottom is"
                f" {bottom}; give one of them"
            )
        object.__setattr__(self, "ladder", ladder)
        object.__setattr__(self, "hi_precision", top)
        object.__setattr__(self, "lo_precision", bottom)

    @property
    def mid_precisions(self) -> tuple[str, ...]:
        """The ladder's tiers between its top and its bottom, hottest first (none for two tiers)."""
        return self.ladder[1:-1] if self.ladder else ()

    @property
    def model_path(self) -> Path:
        return Path(self.model).expanduser()
