"""The one registry of expert precisions (`FORMATS`): names, bits and group sizes per matrix.

Pure data, no torch: the CLI, `EngineConfig`, the prepared-cache keys, the residency, `moetide info`
and `moetide eval` read this table; `store.quant` builds layouts from it. Adding a format here is the
whole change (the layout, packing and dequantization follow the spec).

Names: "hi" (alias "bf16": the checkpoint's dtype), "int<b>" (gate_up and down both b bits),
"int<g>+<d>" (gate_up g bits, down d bits); a "-gptq" suffix marks a calibrated variant (same
layout and bytes; `FormatSpec.calibration`). Group sizes run along each matrix's input dimension
(H for gate_up, I for down); each is the preferred size, halved while it does not divide K
(`quant.default_group_size`); None = the default for that width.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class FormatSpec:
    """One expert precision: bits and group size per matrix (0 bits = "hi", the checkpoint dtype)."""

    name: str
    bits_gate_up: int
    bits_down: int
    group_size_gate_up: int | None = None
    group_size_down: int | None = None
    summary: str = ""
    # "" or "gptq": the codes are chosen by GPTQ against activation statistics of the checkpoint's
    # own forward on calibration data (`store.calibrate`: the demo's ShareGPT training split, never
    # the held-out one). Same layout and bytes as the uncalibrated format of those bits and groups.
    calibration: str = ""

    @property
    def is_low_bit(self) -> bool:
        return self.bits_gate_up > 0

    @property
    def is_mixed(self) -> bool:
        return self.bits_gate_up != self.bits_down


# Ordered from most to fewest bytes. "int2+4" keeps down in int4: down is a third of an expert's
# weights, and its error lands on the residual stream without passing through the SwiGLU gate
# (measured: docs/quantization.md; llama.cpp's Q2_K keeps this projection wider for the same reason).
FORMATS = MappingProxyType(
    {
        "hi": FormatSpec("hi", 0, 0, summary="the checkpoint's dtype (bf16 on a GPU)"),
        "int4": FormatSpec("int4", 4, 4, 64, 64, summary="int4, group 64"),
        "int2+4": FormatSpec(
            "int2+4", 2, 4, 128, 64, summary="int2 gate_up (group 128), int4 down (group 64)"
        ),
        # "-gptq": the same layout, codes chosen by GPTQ on calibration activations (opt-in; never
        # chosen by --lo auto, which meets the uncalibrated format of the same bytes first)
        "int2+4-gptq": FormatSpec(
            "int2+4-gptq", 2, 4, 128, 64, summary="int2+4, GPTQ-calibrated codes", calibration="gptq"
        ),
        # int2 with down's groups 4x smaller: the 2.5 bits of int2 in groups of 64, but a third less
        # of its loss increase on the demo model (docs/quantization.md)
        "int2+2": FormatSpec("int2+2", 2, 2, 128, 32, summary="int2, groups 128 (gate_up) / 32 (down)"),
        "int2+2-gptq": FormatSpec(
            "int2+2-gptq", 2, 2, 128, 32, summary="int2+2, GPTQ-calibrated codes", calibration="gptq"
        ),
        "int2": FormatSpec("int2", 2, 2, 128, 128, summary="int2, group 128"),
    }
)
HI_ALIASES = frozenset({"hi", "bf16"})
LOW_BIT_FORMATS = tuple(name for name, spec in FORMATS.items() if spec.is_low_bit)


def normalize_precision(precision: str) -> str:
    """ "hi"/"bf16" -> "hi"; any other FORMATS name unchanged; anything else: ValueError."""
    if precision in HI_ALIASES:
        return "hi"
    if precision in FORMATS:
        return precision
    raise ValueError(f"precision must be one of {', '.join(precision_names())}; got {precision!r}")


def precision_names(low_bit_only: bool = False) -> tuple[str, ...]:
    """Names a user may type: "bf16" for hi, then every low-bit format (most bytes first)."""
    return LOW_BIT_FORMATS if low_bit_only else ("bf16", *LOW_BIT_FORMATS)


def format_spec(precision: str) -> FormatSpec:
    """The FORMATS entry of a precision name (aliases accepted); ValueError for an unknown one."""
    return FORMATS[normalize_precision(precision)]


def user_name(precision: str) -> str:
    """The name shown to users: "hi" is shown as "bf16"."""
    return "bf16" if normalize_precision(precision) == "hi" else precision


def nominal_bits(precision: str) -> float:
    """Stored bits per expert weight of a format at its preferred group sizes, scales and offsets
    (two float16 per group) included: gate_up holds 2/3 of an expert's weights, down 1/3. "hi" counts
    as bf16 (16). Orders formats by their bytes without a model's shapes (int4 4.5, int2+4 3.0,
    int2+2 2.5, int2 2.25); a calibrated format has the bits of its uncalibrated twin."""
    spec = format_spec(precision)
    if not spec.is_low_bit:
        return 16.0

    def matrix(bits: int, group: int | None) -> float:
        return bits + 32 / (group or 64)

    return 2 / 3 * matrix(spec.bits_gate_up, spec.group_size_gate_up) + 1 / 3 * matrix(
        spec.bits_down, spec.group_size_down
    )


def parse_ladder(text: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A precision ladder, hottest first: `"bf16>int4>int2"` (or a sequence of names) ->
    `("hi", "int4", "int2")`. Every step down must take fewer bytes (`nominal_bits`). ValueError,
    one line, naming the bad part."""
    parts = [p.strip() for p in text.split(">")] if isinstance(text, str) else [str(p).strip() for p in text]
    shown = text if isinstance(text, str) else ">".join(parts)
    if len(parts) < 2 or any(not p for p in parts):
        raise ValueError(f"ladder {shown!r}: give two or more formats, hottest first, e.g. bf16>int4>int2")
    for p in parts:
        if p not in HI_ALIASES and p not in FORMATS:
            raise ValueError(f"ladder {shown!r}: unknown format {p!r}; use {', '.join(precision_names())}")
    ladder = tuple(normalize_precision(p) for p in parts)
    for hot, cold in zip(ladder, ladder[1:]):
        if nominal_bits(cold) >= nominal_bits(hot):
            raise ValueError(
                f"ladder {shown!r}: each format must take fewer bytes than the one before it;"
                f" {user_name(cold)} ({nominal_bits(cold):g} bits/weight) is not smaller than"
                f" {user_name(hot)} ({nominal_bits(hot):g})"
            )
    return ladder


def ladder_name(ladder: tuple[str, ...]) -> str:
    """`("hi", "int4", "int2")` -> `"bf16>int4>int2"`."""
    return ">".join(user_name(p) for p in ladder)
