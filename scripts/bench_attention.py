#!/usr/bin/env python
"""Decode attention over the paged KV cache: what exists, measured per layer call.

One decode step: B rows, one new query token each, row b attending over its `L_b` tokens (the new
one included), whose K/V lie in the engine's per-layer pool `(slots, kv_heads, dim)` in blocks of
16 slots, listed by the row's block table (shuffled, non-contiguous blocks; block 0 is the pad
block). Every variant first writes the new token's K/V at its slot (the engine does this every
layer) and then attends. Per-step work shared by all layers (a mask, a block mask, index lists) is
timed apart, as `setup_us`.

Variants (name: what is called, per layer unless said otherwise):

  gather_sdpa         today's engine: `moetide.engine.paged_cache.PagedKVCache.update` (index_copy_
                      of the new K/V, then a gather of every row's blocks into a dense
                      `(B, kv_heads, W*16, dim)` tensor) and transformers'
                      `integrations.sdpa_attention.sdpa_attention_forward` with the engine's 4D
                      boolean mask (`paged_cache.attention_mask`, built per step: setup). With GQA
                      and a mask, transformers repeats K/V to the query heads (`repeat_kv`).
  flex_paged          `torch.nn.attention.flex_attention.flex_attention` (torch.compile'd on CUDA,
                      eager on CPU) straight over the pool, viewed `(1, kv_heads, slots, dim)`, with a
                      paged `BlockMask` built per step (setup) by `BlockMask.from_kv_blocks`: each
                      row's full blocks as `full_kv_indices` (physical block ids = its block table),
                      its last, partial block as `kv_indices`, and a mask_mod that maps a physical
                      slot to the row's logical position through a physical-to-logical block table
                      (as torch's `experimental._paged_attention.PagedAttention.get_mask_mod` does)
                      and keeps positions < L_b. `enable_gqa=True` for GQA.
  hf_paged_sdpa       transformers' continuous-batching path `paged|sdpa`:
                      `integrations.sdpa_paged.sdpa_attention_paged_forward` with a
                      `generation.continuous_batching.cache.PagedAttentionCache` (its `update`:
                      index_copy_ of the new K/V, `index_select` of every row's slots by a flat
                      `read_index`), over the packed batch `(1, H, B, dim)`: one SDPA of all B
                      queries against all rows' keys with a block-diagonal additive mask `(1, 1, B,
                      sum L_b)` (read_index, write_index and mask per step: setup).
  hf_paged_eager      the same with `integrations.eager_paged.eager_paged_attention_forward`
                      (`paged|eager`: matmul + softmax instead of SDPA).
  hf_paged_flash      `integrations.flash_paged.paged_attention_forward` (`paged|flash_attention_2`
                      or `_3`): its decode path calls flash-attn's `flash_attn_with_kvcache` with the
                      block table (it writes the new K/V itself). Needs the `flash_attn` (or
                      `flash_attn_interface`) package; without it transformers would fetch a kernel
                      from the Hub, so the variant is recorded as unavailable instead.
  torch_varlen_paged  `torch.nn.attention.varlen.varlen_attn(..., seqused_k=, block_table=)` (torch's
                      built-in FlashAttention-2 with a paged KV; only where its signature has
                      `block_table`), pool viewed `(blocks, 16, kv_heads, dim)`.
  triton_paged        our Triton paged-decode kernel (`engine/paged_attention.py`): one program per
                      (row, kv head, split of the row's tokens), all the kv head's query heads at
                      once (GQA), K/V read straight from the pool through the block table, per-row
                      length from a device tensor, online softmax; split-K over the tokens with a
                      second kernel combining the splits (splits chosen from the static shapes only,
                      so a captured graph stays valid).
  triton_paged_nosplit  the same kernel with one split (no combine kernel).

The hf_paged_* variants attend with all B queries packed as one sequence, so their attention does
B x sum(L_b) work (the mask discards all but each row's own columns). On CPU, flex_attention runs
eagerly, which evaluates the mask_mod over every pool slot and ignores the BlockMask's block lists:
there the check covers the mask_mod, on CUDA the compiled kernel's block lists too.

Every output is compared with a float32 reference (dense attention over each row's tokens in
order, read from the pool by plain indexing): `max_abs_err`. On CUDA each variant's per-layer call
is timed with `triton.testing.do_bench` (`us`, median), its per-step setup likewise (`setup_us`),
and it is captured into a CUDA graph with fixed buffers and replayed (`graph_capturable`: the
replay ran and matched the eager output, else False with `graph_error`; `graph_us`: the replay's
time). `first_call_s` is the first call's wall time (compilation for flex / Triton).

    python scripts/bench_attention.py --out results/attention.json                # CUDA
    TRITON_INTERPRET=1 python scripts/bench_attention.py --device cpu --quick --out /tmp/a.json

On CPU (`--device cpu`) only the correctness checks run (no timings), Triton under its interpreter
(TRITON_INTERPRET=1 is set before triton is imported). `--max-seconds` (from process start) skips the
remaining cases and still writes the JSON; each variant also has a time budget (`--variant-seconds`).
"""

from __future__ import annotations

import time

_T0 = time.monotonic()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402


def _device_from_argv(argv) -> str:
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cuda"


if __name__ == "__main__" and _device_from_argv(sys.argv).startswith("cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton (and each kernel) is imported
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile-worker pool to start

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

PAGE = 16  # the engine's block size

# (query heads, kv heads, head dim); Qwen1.5-MoE-A2.7B's attention is OLMoE's (16 / 16 / 128)
SHAPES = {
    "olmoe-1b-7b": (16, 16, 128),
    "qwen3-30b-a3b": (32, 4, 128),
}
QUICK_SHAPES = {
    "tiny-mha": (2, 2, 32),
    "tiny-gqa": (8, 2, 32),
}
BATCHES, CONTEXTS = (1, 8, 32, 64), (128, 512, 2048)
QUICK_BATCHES, QUICK_CONTEXTS = (3,), (37,)


# -- our Triton kernel: the engine's (engine/paged_attention.py) ------------------------------------------
try:
    from moetide.engine.paged_attention import paged_decode_attention

    HAS_TRITON = True
except Exception:  # noqa: BLE001
    HAS_TRITON = False


def paged_decode(q, k_pool, v_pool, block_tables, lens, *, scale, splits=None):
    """The engine's kernel on a case's `q (B, Hq, 1, D)` -> `(B, Hq, D)`."""
    return paged_decode_attention(q[:, :, 0], k_pool, v_pool, block_tables, lens, scale, PAGE, splits=splits)


# -- cases ----------------------------------------------------------------------------------------------
class Unavailable(Exception):
    """The variant cannot run here (a missing package or API); recorded as its error."""


class Pools:
    """One layer's K and V pools for a shape, `(slots, Hkv, D)`, random, block 0 zero (the pad)."""

    def __init__(self, hkv, d, num_blocks, device, dtype, gen):
        slots = (num_blocks + 1) * PAGE
        self.num_blocks = num_blocks
        self.k = torch.randn(slots, hkv, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.v = torch.randn(slots, hkv, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.k[:PAGE].zero_()
        self.v[:PAGE].zero_()


class Case:
    """One decode step's inputs over `pools`: shuffled blocks, the new tokens' q/k/v, the reference."""

    def __init__(self, shape_name, shape, lens, pools: Pools, device, dtype, gen):
        hq, hkv, d = shape
        self.shape_name, self.shape, self.device, self.dtype = shape_name, shape, device, dtype
        self.hq, self.hkv, self.d, self.group = hq, hkv, d, hq // hkv
        self.pools = pools
        self.lens_list = [int(x) for x in lens]
        rows = self.rows = len(lens)
        nblk = [math.ceil(n / PAGE) for n in self.lens_list]
        self.width = max(nblk)
        if sum(nblk) > pools.num_blocks:
            raise ValueError("pool too small for the case")
        perm = torch.randperm(pools.num_blocks, generator=torch.Generator().manual_seed(sum(lens) + rows)) + 1
        tables = torch.zeros(rows, self.width, dtype=torch.long)
        used = 0
        for r, nb in enumerate(nblk):
            tables[r, :nb] = perm[used : used + nb]
            used += nb
        self.tables_cpu = tables
        self.block_tables = tables.to(device)
        self.lens = torch.tensor(self.lens_list, dtype=torch.int32, device=device)
        last = torch.tensor(self.lens_list) - 1
        slots = tables[torch.arange(rows), last // PAGE] * PAGE + last % PAGE
        self.slot_mapping = slots.to(device)
        self.positions = last.view(-1, 1).to(device)
        # the model's layout: q (B, Hq, 1, D), new k/v (B, Hkv, 1, D)
        self.q = (2 * torch.randn(rows, hq, 1, d, generator=gen, device=device)).to(dtype)
        self.k_new = torch.randn(rows, hkv, 1, d, generator=gen, device=device).to(dtype)
        self.v_new = torch.randn(rows, hkv, 1, d, generator=gen, device=device).to(dtype)
        self.scale = 1.0 / math.sqrt(d)
        self.reference = self._reference()

    def label(self):
        if len(set(self.lens_list)) == 1:
            return self.lens_list[0]
        return f"mixed:{min(self.lens_list)}-{max(self.lens_list)}"

    def _reference(self):
        """float32 dense attention over each row's tokens 0..L-1 in order (the new one written)."""
        k_pool, v_pool = self.pools.k.clone(), self.pools.v.clone()
        k_pool[self.slot_mapping] = self.k_new[:, :, 0]
        v_pool[self.slot_mapping] = self.v_new[:, :, 0]
        lmax = max(self.lens_list)
        t = torch.arange(lmax)
        slot = self.tables_cpu[:, (t // PAGE).clamp(max=self.width - 1)] * PAGE + t % PAGE  # (B, Lmax)
        keep = (t.view(1, -1) < torch.tensor(self.lens_list).view(-1, 1)).to(self.device)
        slot = slot.to(self.device)
        k = k_pool[slot].float()  # (B, Lmax, Hkv, D)
        v = v_pool[slot].float()
        q = self.q[:, :, 0].float().view(self.rows, self.hkv, self.group, self.d)
        scores = torch.einsum("bkgd,blkd->bkgl", q, k) * self.scale
        scores = scores.masked_fill(~keep.view(self.rows, 1, 1, lmax), float("-inf"))
        out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(-1), v)
        return out.reshape(self.rows, self.hq, self.d)

    def packed(self):
        """q, k, v of the continuous-batching layout: the batch packed as one sequence `(1, H, B, D)`."""
        return tuple(x.permute(2, 1, 0, 3).contiguous() for x in (self.q, self.k_new, self.v_new))

    def write_new(self):
        """What every pooled variant does first per layer: the new token's K/V into the pool."""
        self.pools.k.index_copy_(0, self.slot_mapping, self.k_new[:, :, 0])
        self.pools.v.index_copy_(0, self.slot_mapping, self.v_new[:, :, 0])


# -- variants: prepare(case) -> (setup() -> state, layer(state) -> output (B, Hq, D)-able) ---------------
def prep_gather_sdpa(case: Case):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from moetide.engine.paged_cache import PagedKVCache, attention_mask

    cache = PagedKVCache(case.pools.num_blocks, PAGE, case.device, grow=False)
    cache.keys[0], cache.values[0] = case.pools.k, case.pools.v
    module = types.SimpleNamespace(num_key_value_groups=case.group, is_causal=True, layer_idx=0)
    columns = torch.arange(case.width * PAGE, device=case.device)

    def setup():
        cache.set_step(case.slot_mapping, case.block_tables)
        return attention_mask(case.positions, columns)

    def layer(mask):
        k, v = cache.update(case.k_new, case.v_new, 0)
        out, _ = sdpa_attention_forward(module, case.q, k, v, mask, dropout=0.0, scaling=case.scale)
        return out  # (B, 1, Hq, D)

    return setup, layer


_FLEX = {}


def _flex_fn(device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention  # eager: the dense math path (mask_mod over every slot)
    if "cuda" not in _FLEX:
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        _FLEX["cuda"] = torch.compile(flex_attention)
    return _FLEX["cuda"]


def prep_flex_paged(case: Case):
    from torch.nn.attention.flex_attention import BlockMask

    flex = _flex_fn(case.device)
    dev, rows, width = case.device, case.rows, case.width
    n_pages = case.pools.num_blocks + 1
    # fixed buffers, refilled per step (the compiled kernel and a captured graph read them)
    p2l = torch.full((rows, n_pages), -1, dtype=torch.int32, device=dev)
    lens = case.lens.clone()
    kv_num = torch.ones(rows, 1, 1, dtype=torch.int32, device=dev)
    kv_idx = torch.zeros(rows, 1, 1, n_pages, dtype=torch.int32, device=dev)
    full_num = torch.zeros(rows, 1, 1, dtype=torch.int32, device=dev)
    full_idx = torch.zeros(rows, 1, 1, n_pages, dtype=torch.int32, device=dev)
    cols = torch.arange(width, device=dev, dtype=torch.int32)
    page = PAGE  # a closure constant, no module global for dynamo to look up

    def mask_mod(b, h, q_idx, kv_idx_):
        logical = p2l[b, kv_idx_ // page]
        return (logical >= 0) & (logical * page + kv_idx_ % page < lens[b])

    k4 = case.pools.k.permute(1, 0, 2).unsqueeze(0)  # (1, Hkv, slots, D), a view of the pool
    v4 = case.pools.v.permute(1, 0, 2).unsqueeze(0)

    def setup():
        tables = case.block_tables.to(torch.int32)
        nblk = (case.lens + PAGE - 1) // PAGE
        lens.copy_(case.lens)
        p2l.fill_(-1)
        p2l.scatter_(1, case.block_tables, torch.where(cols < nblk.view(-1, 1), cols, -1).expand(rows, -1))
        full_num.copy_((nblk - 1).view(rows, 1, 1))
        full_idx[:, 0, 0, :width].copy_(tables)
        kv_idx[:, 0, 0, 0].copy_(tables.gather(1, (nblk - 1).long().view(-1, 1)).view(-1))
        args = (kv_num, kv_idx, full_num, full_idx)
        kwargs = dict(BLOCK_SIZE=(128, PAGE), mask_mod=mask_mod, seq_lengths=(1, n_pages * PAGE))
        try:
            return BlockMask.from_kv_blocks(*args, compute_q_blocks=False, **kwargs)
        except TypeError:  # a torch without compute_q_blocks
            return BlockMask.from_kv_blocks(*args, **kwargs)

    def layer(block_mask):
        case.write_new()
        return flex(case.q, k4, v4, block_mask=block_mask, scale=case.scale, enable_gqa=case.group > 1)

    return setup, layer


def _hf_cache(case: Case):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    # the real class's update(), on the bench's pools (its __init__ sizes a cache from a model config)
    cache = object.__new__(PagedAttentionCache)
    cache.layer_index_to_group_indices = {0: (0, 0)}
    cache.sliding_windows = {0: 1}
    cache.key_cache, cache.value_cache = [case.pools.k], [case.pools.v]
    cache.block_size, cache.num_key_value_heads, cache.head_dim = PAGE, case.hkv, case.d
    cache.sentinel_index = 1
    cache._block_table_key = None
    return cache


def _hf_step(case: Case):
    """What continuous batching builds per step for a decode batch: the flat read index (every row's
    slots in order), the write index and the block-diagonal additive mask."""
    t = [torch.arange(n) for n in case.lens_list]
    read = torch.cat([case.tables_cpu[r, ti // PAGE] * PAGE + ti % PAGE for r, ti in enumerate(t)])
    bounds = torch.tensor([0] + case.lens_list).cumsum(0)
    total = int(bounds[-1])
    col_row = torch.repeat_interleave(torch.arange(case.rows), torch.tensor(case.lens_list))
    allowed = col_row.view(1, -1) == torch.arange(case.rows).view(-1, 1)
    mask = torch.zeros(1, 1, case.rows, total, dtype=case.dtype)
    mask.masked_fill_(~allowed.view(1, 1, case.rows, total), torch.finfo(case.dtype).min)
    dev = case.device
    return read.to(dev, non_blocking=True), case.slot_mapping, mask.to(dev, non_blocking=True), bounds


def _prep_hf_packed(case: Case, forward):
    cache = _hf_cache(case)
    module = types.SimpleNamespace(layer_idx=0, num_key_value_groups=case.group, is_causal=True)
    q, k, v = case.packed()

    def setup():
        read, write, mask, _ = _hf_step(case)
        return [read], [write], mask

    def layer(state):
        read, write, mask = state
        out, _ = forward(
            module, q, k, v, mask, scaling=case.scale, cache=cache, read_index=read, write_index=write
        )
        return out  # (1, B, Hq, D)

    return setup, layer


def prep_hf_paged_sdpa(case: Case):
    from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

    return _prep_hf_packed(case, sdpa_attention_paged_forward)


def prep_hf_paged_eager(case: Case):
    from transformers.integrations.eager_paged import eager_paged_attention_forward

    return _prep_hf_packed(case, eager_paged_attention_forward)


def prep_hf_paged_flash(case: Case):
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if case.device.type != "cuda":
        raise Unavailable("flash attention needs CUDA")
    if is_flash_attn_3_available():
        impl = "paged|flash_attention_3"
    elif is_flash_attn_2_available():
        impl = "paged|flash_attention_2"
    else:
        raise Unavailable(
            "neither flash_attn nor flash_attn_interface is installed (transformers would fetch a Hub kernel)"
        )
    from transformers.integrations.flash_paged import paged_attention_forward

    cache = _hf_cache(case)
    config = types.SimpleNamespace(_attn_implementation=impl)
    module = types.SimpleNamespace(layer_idx=0, scaling=case.scale, sliding_window=None, config=config)
    q, k, v = case.packed()

    def setup():
        bounds = torch.tensor([0] + case.lens_list, dtype=torch.int32).cumsum(0).to(torch.int32)
        tables = case.tables_cpu.to(torch.int32)
        for r, n in enumerate(case.lens_list):
            tables[r, math.ceil(n / PAGE) :] = -1
        return (
            torch.arange(case.rows + 1, dtype=torch.int32).to(case.device),
            bounds.to(case.device),
            tables.unsqueeze(0).to(case.device),
        )

    def layer(state):
        cu_q, cu_k, table = state
        out, _ = paged_attention_forward(
            module, q, k, v, None, cache, cu_q, cu_k, 1, max(case.lens_list), block_table=table
        )
        return out  # (B, Hq, D)

    return setup, layer


def prep_torch_varlen_paged(case: Case):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise Unavailable(f"torch.nn.attention.varlen: {e}") from None
    if "block_table" not in inspect.signature(varlen_attn).parameters:
        raise Unavailable("this torch's varlen_attn has no block_table (paged KV) argument")
    if case.device.type != "cuda":
        raise Unavailable("varlen_attn (FlashAttention) needs CUDA")
    kp = case.pools.k.view(-1, PAGE, case.hkv, case.d)
    vp = case.pools.v.view(-1, PAGE, case.hkv, case.d)
    q = case.q[:, :, 0]  # (B, Hq, D): T_q = B

    def setup():
        dev = case.device
        cu_q = torch.arange(case.rows + 1, dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + case.lens_list).cumsum(0).to(torch.int32).to(dev)
        return cu_q, cu_k, case.lens.clone(), case.block_tables.to(torch.int32)

    def layer(state):
        cu_q, cu_k, used, table = state
        case.write_new()
        return varlen_attn(
            q, kp, vp, cu_q, cu_k, 1, max(case.lens_list), scale=case.scale, enable_gqa=case.group > 1,
            seqused_k=used, block_table=table,
        )  # fmt: skip

    return setup, layer


def _prep_triton(case: Case, splits):
    if not HAS_TRITON:
        raise Unavailable("triton is not installed")

    def setup():
        return case.block_tables, case.lens

    def layer(state):
        tables, lens = state
        case.write_new()
        return paged_decode(case.q, case.pools.k, case.pools.v, tables, lens, scale=case.scale, splits=splits)

    return setup, layer


def prep_triton_paged(case: Case):
    return _prep_triton(case, None)


def prep_triton_paged_nosplit(case: Case):
    return _prep_triton(case, 1)


# (the ones that might leave CUDA in a bad state after a failed capture run last in each case)
VARIANTS = {
    "gather_sdpa": prep_gather_sdpa,
    "triton_paged": prep_triton_paged,
    "triton_paged_nosplit": prep_triton_paged_nosplit,
    "hf_paged_sdpa": prep_hf_paged_sdpa,
    "hf_paged_eager": prep_hf_paged_eager,
    "flex_paged": prep_flex_paged,
    "torch_varlen_paged": prep_torch_varlen_paged,
    "hf_paged_flash": prep_hf_paged_flash,
}


# -- measuring ------------------------------------------------------------------------------------------
def _as_bhd(out, case: Case) -> torch.Tensor:
    if isinstance(out, tuple):
        out = out[0]
    if out.dim() == 4 and out.shape[0] == 1 and case.rows != 1 and out.shape[1] == case.rows:
        out = out[0]  # (1, B, Hq, D)
    return out.reshape(case.rows, case.hq, case.d).float()


def _bench_us(fn) -> float:
    from triton.testing import do_bench

    try:
        ms = do_bench(fn, warmup=10, rep=30, return_mode="median")
    except TypeError:
        ms = do_bench(fn, warmup=10, rep=30)
    return round(float(ms) * 1000.0, 2)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:400]


def _graph(layer, state, eager: torch.Tensor, case: Case, timed: bool):
    """Capture `layer(state)` into a CUDA graph, replay it, compare with the eager output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(state)
    graph.replay()
    torch.cuda.synchronize()
    diff = (_as_bhd(out, case) - eager).abs().max().item()
    if not diff <= 1e-3:
        return False, None, f"replay differs from eager by {diff:.3g}"
    return True, (_bench_us(graph.replay) if timed else None), None


def _row(name, shape_name, shape, lens, error=None) -> dict:
    context = lens[0] if len(set(lens)) == 1 else f"mixed:{min(lens)}-{max(lens)}"
    return {
        "variant": name, "shape": shape_name, "heads": list(shape), "batch": len(lens), "context": context,
        "us": None, "setup_us": None, "graph_capturable": None, "graph_us": None, "first_call_s": None,
        "max_abs_err": None, "error": error,
    }  # fmt: skip


def run_variant(name: str, case: Case, timed: bool) -> dict:
    row = _row(name, case.shape_name, case.shape, case.lens_list)
    cuda = case.device.type == "cuda"
    try:
        setup, layer = VARIANTS[name](case)
        state = setup()
        t = time.perf_counter()
        out = layer(state)
        if cuda:
            torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t, 3)
        eager = _as_bhd(out, case)
        row["max_abs_err"] = float((eager - case.reference).abs().max().item())
        if timed:
            row["us"] = _bench_us(lambda: layer(state))
            row["setup_us"] = _bench_us(setup)
    except Unavailable as e:
        row["error"] = f"unavailable: {e}"
        return row
    except Exception as e:  # noqa: BLE001
        row["error"] = _short(e)
        if os.environ.get("BENCH_ATTENTION_TRACEBACK"):
            traceback.print_exc()
        return row
    if cuda:
        try:
            row["graph_capturable"], row["graph_us"], graph_error = _graph(layer, state, eager, case, timed)
            if graph_error:
                row["graph_error"] = graph_error
        except Exception as e:  # noqa: BLE001
            row["graph_capturable"] = False
            row["graph_error"] = _short(e)
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
    return row


def case_plan(quick: bool):
    """(shape name, shape, lens) in the order they run (so that a --max-seconds cut drops the least
    telling cases): one mixed-length case per shape, then the grid from the most KV (B x context)
    to the least, both shapes interleaved."""
    shapes = QUICK_SHAPES if quick else SHAPES
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if quick else (BATCHES, CONTEXTS)
    plan = []
    gen = torch.Generator().manual_seed(7)
    for name, shape in shapes.items():
        if quick:
            lens = [1, 17, 40]  # a row holding only its new token, one just past a block, one longer
        else:
            lens = torch.randint(16, 2049, (32,), generator=gen).tolist()
            lens[0], lens[1] = 1, 2048
        plan.append((name, shape, lens))
    for b, c in sorted(((b, c) for b in batches for c in contexts), key=lambda bc: (-bc[0] * bc[1], -bc[0])):
        for name, shape in shapes.items():
            plan.append((name, shape, [c] * b))
    return plan


def correctness(
    device="cpu", quick=True, variants=None, max_seconds=None, variant_seconds=None, timed=False, emit=None
):
    """Run every variant over the plan's cases; returns the rows (see the module doc)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = list(variants or VARIANTS)
    plan = case_plan(quick)
    pools: dict[str, Pools] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    spent = dict.fromkeys(names, 0.0)
    slowest = dict.fromkeys(names, 0.0)  # each variant's longest case so far (compilation included)
    rows = []

    def record(row):
        rows.append(row)
        if emit:
            emit(row)

    def out_of_time():
        if max_seconds is not None and time.monotonic() - _T0 > max_seconds:
            return f"skipped: --max-seconds {max_seconds} reached"
        return None

    for shape_name, shape, lens in plan:
        skip, case = out_of_time(), None
        if skip is None:
            try:
                if shape_name not in pools:
                    blocks = [sum(math.ceil(n / PAGE) for n in ls) for s, _, ls in plan if s == shape_name]
                    pools[shape_name] = Pools(shape[1], shape[2], max(blocks), device, dtype, gen)
                case = Case(shape_name, shape, lens, pools[shape_name], device, dtype, gen)
            except Exception as e:  # noqa: BLE001
                skip = f"case setup failed: {_short(e)}"
        for name in names:
            skip = skip or out_of_time()
            if skip is None and variant_seconds is not None and spent[name] > variant_seconds:
                budget = f"skipped: variant time budget {variant_seconds} s spent"
                record(_row(name, shape_name, shape, lens, budget))
                continue
            left = None if max_seconds is None else max_seconds - (time.monotonic() - _T0)
            if skip is None and left is not None and slowest[name] > left:
                late = f"skipped: its slowest case ({slowest[name]:.1f} s) would pass --max-seconds"
                record(_row(name, shape_name, shape, lens, late))
                continue
            if skip is not None:
                record(_row(name, shape_name, shape, lens, skip))
                continue
            t = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = run_variant(name, case, timed)
            spent[name] += time.monotonic() - t
            slowest[name] = max(slowest[name], time.monotonic() - t)
            record(row)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the CPU correctness check)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument(
        "--max-seconds", type=float, default=85.0, help="from process start; later cases are skipped"
    )
    parser.add_argument("--variant-seconds", type=float, default=25.0, help="each variant's time budget")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available (use --device cpu --quick)")
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    import transformers

    report = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": getattr(triton, "__version__", None),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "block_size": PAGE,
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
        "quick": args.quick,
        "rows": [],
    }
    out_path = Path(args.out)

    def write():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        report["wall_s"] = round(time.monotonic() - _T0, 1)
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(out_path)

    def emit(row):
        print(json.dumps(row), flush=True)
        report["rows"].append(row)

    try:
        timed = device.type == "cuda"
        correctness(device, args.quick, names, args.max_seconds, args.variant_seconds, timed=timed, emit=emit)
    except BaseException as e:  # noqa: BLE001  (still write what was measured)
        report["error"] = _short(e)
        traceback.print_exc()
    finally:
        write()
    errors = [r for r in report["rows"] if r["error"]]
    rows = len(report["rows"])
    print(f"wrote {out_path}: {rows} rows, {len(errors)} with an error, {report['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
