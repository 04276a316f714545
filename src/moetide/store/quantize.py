"""Group-wise low-bit quantization of one matrix: the methods that choose codes, scales and offsets.

One matrix W (N, K) is quantized in groups of `group_size` consecutive elements along K:
    code   = clamp(round((W - offset) / scale), 0, 2**bits - 1)      uint8, one per element
    W_hat  = code * scale + offset                                   (dequantized, one FMA)
    scale, offset: (N, K // group_size) float16 (PARAM_DTYPE)
Methods (`QUANT_METHODS`): "rtn" (min/max), "mse" (clip-ratio search), "hqq" (half-quadratic offset
refinement), "ls" (clip ratios, then least-squares refits; the default) and "gptq" (Hessian-aware,
needs calibration activations). Pure functions of their inputs; the same calls run on CPU and CUDA.
Packing and the kernel-ready expert buffers are in `quant`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Scales and offsets are stored in float16, not bfloat16: float16 keeps 11 significant bits against
# bfloat16's 8, so a stored scale is off by at most 2^-11 (0.05 %) of itself instead of 2^-8 (0.4 %),
# an error that would be shared by every element of the group. float16's narrower range is harmless
# here: scales are range / (2^bits - 1) and offsets are group minima, both of the weights' magnitude
# (expert weights are O(1e-2)); `quantize` refuses weights beyond float16's range rather than
# silently overflowing. Measured effect: docs/quantization.md.
PARAM_DTYPE = torch.float16

# Chosen by measurement (docs/quantization.md): among 32/64/128, the group size minimizing
# expert-output error x (bytes per weight)^2 over two synthetic weight models. Bytes count twice because
# they cost both residency capacity and copy/read time. With the "mse" range search, int2 gains little
# from groups below 128, unlike plain min/max RTN (the DynaExq authors' code uses int4 g128 / int2 g64).
DEFAULT_GROUP_SIZE = MappingProxyType({4: 64, 2: 128})
MIN_DEFAULT_GROUP_SIZE = 16  # the default halves down to this when it does not divide K


QUANT_METHODS = frozenset({"rtn", "mse", "hqq", "ls", "gptq"})
DEFAULT_QUANT_METHOD = "ls"

# "ls": a few clip ratios, then joint least-squares refits of scale and offset (below). Measured on
# the demo model's experts against "hqq" (13 ratios + 20 offset-only HQQ steps): 0.4-1.1 % less
# squared error for int4 g64 and int2 g64/g128, in a sixth of the time (docs/quantization.md). The
# ratios bracket where "mse" lands (int4: 0.9-1.0, int2: 0.55-0.65); the refits move scales off them.
LS_CLIP_RATIOS = MappingProxyType({4: (1.0, 0.95, 0.9, 0.8), 2: (1.0, 0.8, 0.7, 0.6, 0.5, 0.4)})
LS_ITERS = 6
# Elements per chunk of rows: a chunk's float32 temporaries (1 MiB each) stay in the CPU's caches.
QUANT_CHUNK_ELEMENTS = 1 << 18
# On a GPU the chunk only bounds the temporaries' memory (16M elements: ~64 MiB each); small chunks
# there cost one kernel launch per op per chunk (a batch of OLMoE experts is 240 chunks of 2^18).
# Rows are independent, so the chunking never changes a result.
QUANT_CHUNK_ELEMENTS_GPU = 1 << 24

# Clip ratios tried by the "mse" range search: the group's [min, max] window shrunk about its midpoint.
# Low-bit grids waste levels on the few extreme weights: on Gaussian weights the chosen ratio is
# 0.9-1.0 for int4 (group 64) and 0.55-0.65 for int2 (group 128), 10th-90th percentile.
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(13))  # 1.00, 0.95, ..., 0.40

# HQQ half-quadratic proximal solver on the offset only (Badri & Shaji, 2023): the paper's defaults
# for the l_p shrink (p < 1 is robust to the few large errors) and its schedule beta <- kappa * beta.
# At expert-weight magnitudes the shrink threshold |e|^(p-1) / beta exceeds |e| for every error below
# beta^(-1 / (2 - p)) ~ 0.17, so the sparse term is zero and each step refits the offset to the mean
# residual (alternating least squares); it still lowers the error measurably (docs/quantization.md).
HQQ_ITERS = 20
HQQ_LP_NORM = 0.7
HQQ_BETA = 10.0
HQQ_KAPPA = 1.01


class QuantizedMatrix(NamedTuple):
    """One matrix W (N, K) quantized group-wise along K.

    codes   (N, K) uint8, values in [0, 2**bits - 1] (unpacked)
    scale   (N, K // group_size) float16
    offset  (N, K // group_size) float16
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group_size: int


# ---------------------------------------------------------------------------------------------
# Quantize / dequantize one matrix
# ---------------------------------------------------------------------------------------------


def quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    method: str = DEFAULT_QUANT_METHOD,
    importance: torch.Tensor | None = None,
) -> QuantizedMatrix:
    """Asymmetric group-wise quantization of `weight` (N, K) along K.

    weight: (N, K), any float dtype; K must be a multiple of `group_size`.
    bits: 4 or 2. group_size: None = `default_group_size(bits, K)`.
    method (all round to nearest; they differ in how each group's scale and offset are chosen):
      "rtn"  scale and offset from the group's min and max;
      "mse"  the clip ratio in CLIP_RATIOS with the least squared error per group (1.0 is "rtn");
      "hqq"  "mse", then the half-quadratic proximal refinement of the offsets (HQQ).
      "ls"   (default) the LS_CLIP_RATIOS windows, then LS_ITERS joint least-squares refits of
             (scale, offset) to the codes; fewer passes than "hqq" and a lower error (see above).
    Each step keeps, per group, whichever parameters have the lower squared error, so in Frobenius
    norm "hqq" <= "mse" <= "rtn" and "ls" <= "rtn" group by group.
    Rows are independent: any stack of matrices with the same K may be quantized as one (N, K).
    importance ("ls" only): None, or (N, K) / (K,) non-negative weights of each element's squared
    error, e.g. the mean square of the input channel's activations (activation-aware: the expected
    output error of a row is ~ sum_k E[x_k^2] (w_k - w_hat_k)^2).
    Returns codes (N, K) uint8, scale and offset (N, K // group_size) float16.
    """
    group_size = _check_quant_args(weight, bits, group_size, method)
    if importance is not None and method != "ls":
        raise ValueError("importance weights need method 'ls'")
    if method == "ls":
        return _quantize_ls(weight, bits, group_size, importance)
    groups = _as_groups(weight.to(torch.float32), group_size)  # (N, G, g)
    qmax = 2**bits - 1
    if method == "rtn":
        scale, offset = _min_max_params(groups, qmax)
    else:
        scale, offset = _mse_clipped_params(groups, qmax)
    if method == "hqq":
        offset = _hqq_refine_offset(groups, scale, offset, qmax)
    codes = _codes_for(groups, scale, offset, qmax)
    n_rows, k = weight.shape
    return QuantizedMatrix(
        codes=codes.reshape(n_rows, k),
        scale=scale.squeeze(-1).to(PARAM_DTYPE),
        offset=offset.squeeze(-1).to(PARAM_DTYPE),
        bits=bits,
        group_size=group_size,
    )


def _quantize_ls(
    weight: torch.Tensor, bits: int, group_size: int, importance: torch.Tensor | None = None
) -> QuantizedMatrix:
    """The "ls" method, in chunks of rows (see QUANT_CHUNK_ELEMENTS). weight (N, K).

    On the CPU, chunks run on one Python thread per intra-op thread, each op single-threaded: the
    chunk's ops are small, and splitting each one over OpenMP threads cost 5-40x more time than it
    saved on the 2-core machine when other processes held the cores (measured: 0.09 s vs 0.8-4.6 s
    of CPU for 1 M int2 weights). torch releases the GIL inside ops, so the threads run in parallel.
    """
    n_rows, k = weight.shape
    codes = torch.empty((n_rows, k), dtype=torch.uint8, device=weight.device)
    scale = torch.empty((n_rows, k // group_size), dtype=PARAM_DTYPE, device=weight.device)
    offset = torch.empty_like(scale)
    chunk = QUANT_CHUNK_ELEMENTS if weight.device.type == "cpu" else QUANT_CHUNK_ELEMENTS_GPU
    step = max(1, chunk // k)
    chunks = [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]

    if importance is not None:
        importance = importance.to(weight.device, torch.float32).expand(n_rows, k)

    def run(rows: slice) -> None:
        groups = _as_groups(weight[rows].to(torch.float32), group_size)
        weights = None if importance is None else _as_groups(importance[rows].contiguous(), group_size)
        s, o, c = _ls_params(groups, bits, weights)
        codes[rows] = c.reshape(-1, k).to(torch.uint8)
        scale[rows] = s.squeeze(-1).to(PARAM_DTYPE)
        offset[rows] = o.squeeze(-1).to(PARAM_DTYPE)

    if weight.device.type != "cpu" or len(chunks) == 1:
        for rows in chunks:
            run(rows)
    else:
        _run_single_threaded_ops(run, chunks)
    return QuantizedMatrix(codes, scale, offset, bits, group_size)


def _run_single_threaded_ops(fn, items) -> None:
    """fn(item) for every item on torch.get_num_threads() Python threads, intra-op threads set to
    1 meanwhile (process-wide: quantization runs while a model loads, before anything is served)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(fn, items))  # list(): re-raise the first error
    finally:
        torch.set_num_threads(workers)


def _scaled_codes(groups: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmax: int):
    """(codes, t) with t = (W - offset) / scale and codes = clamp(round(t), 0, qmax), both float32
    (N, G, g); the squared error of a group is then scale^2 * sum((codes - t)^2)."""
    inv = 1.0 / scale
    t = torch.addcmul(-offset * inv, groups, inv)
    return t.round().clamp_(0, qmax), t


def _dot(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per group sum of weights * x * y over the last dim: (N, G, g) -> (N, G, 1)."""
    return torch.linalg.vecdot(x if weights is None else x * weights, y, dim=-1).unsqueeze(-1)


def _code_error(codes, t, scale, weights=None) -> torch.Tensor:
    r = codes - t
    return _dot(r, r, weights) * scale.square()


def _ls_params(groups: torch.Tensor, bits: int, weights: torch.Tensor | None = None):
    """(scale, offset) per group (N, G, 1), already PARAM_DTYPE-rounded, and codes (N, G, g) float32.

    Start: the best of LS_CLIP_RATIOS windows. Then LS_ITERS times: fix the codes c, solve
    min over (s, o) of sum a * (c*s + o - W)^2 in closed form (weighted linear regression of W on c,
    a = `weights` (N, G, g) or 1), round to PARAM_DTYPE, recompute the codes; a group keeps new
    parameters only if its (weighted) error drops.
    """
    qmax = 2**bits - 1
    tiny = torch.finfo(PARAM_DTYPE).tiny
    g = groups.shape[-1]
    w_min, w_max = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    midpoint, width = (w_max + w_min) / 2, w_max - w_min
    best = None
    for ratio in LS_CLIP_RATIOS[bits]:
        scale = _round_param((width * (ratio / qmax)).clamp_min(tiny))
        offset = _round_param(midpoint - width * (ratio / 2))
        codes, t = _scaled_codes(groups, scale, offset, qmax)
        error = _code_error(codes, t, scale, weights)
        if best is None:
            best = [scale, offset, error, codes]
            continue
        better = error < best[2]
        best = [torch.where(better, new, old) for new, old in zip((scale, offset, error, codes), best)]
    scale, offset, error, codes = best
    if weights is None:
        total, sum_w = float(g), groups.sum(-1, keepdim=True)
    else:  # a group with no importance at all is fitted unweighted
        weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, torch.ones_like(weights))
        total, sum_w = weights.sum(-1, keepdim=True), _dot(weights, groups, None)
    for _ in range(LS_ITERS):
        weighted_codes = codes if weights is None else codes * weights
        sum_c = weighted_codes.sum(-1, keepdim=True)
        var_c = _dot(weighted_codes, codes, None) - sum_c.square() / total
        cov = _dot(weighted_codes, groups, None) - sum_c * sum_w / total
        # a group whose codes are all equal has no slope to fit: it keeps its scale
        new_scale = _round_param(torch.where(var_c > 0, cov / var_c.clamp_min(1e-30), scale).clamp_min(tiny))
        new_offset = _round_param((sum_w - new_scale * sum_c) / total)
        new_codes, t = _scaled_codes(groups, new_scale, new_offset, qmax)
        new_error = _code_error(new_codes, t, new_scale, weights)
        better = new_error < error
        scale = torch.where(better, new_scale, scale)
        offset = torch.where(better, new_offset, offset)
        error = torch.where(better, new_error, error)
        codes = torch.where(better, new_codes, codes)
    return scale, offset, codes


# GPTQ (Frantar et al., 2022) on each expert's input statistics: columns are rounded one at a time
# and each rounding error is spread over the columns not yet rounded through the inverse Hessian's
# Cholesky factor, so the expert's *output* error on the calibration inputs is what gets minimized,
# not the weight error. Groups keep the asymmetric (scale, offset) of the layout; a group's pair is
# fixed when its first column is reached, from the LS_CLIP_RATIOS window with the least
# Hessian-diagonal-weighted error on the (already error-compensated) weights. GPTQ_DAMP: the paper's
# dampening, a share of the mean diagonal added to the diagonal (keeps the factorization stable for
# channels the calibration data barely excites). Measured on the demo model: docs/quantization.md.
GPTQ_DAMP = 0.01
GPTQ_BLOCK = 32


def quantize_gptq(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int | None = None
) -> QuantizedMatrix:
    """GPTQ of P matrices at once: weight (P, N, K), hessian (P, K, K) = sum over calibration
    inputs x (K,) of x x^T for each matrix (any scale: only its shape matters). A matrix whose
    Hessian is all zero (never selected during calibration) gets the identity, i.e. plain
    column-by-column rounding. Returns the QuantizedMatrix of the (P * N, K) stack."""
    if weight.dim() != 3 or hessian.shape != (weight.shape[0], weight.shape[2], weight.shape[2]):
        raise ValueError(
            "expected weight (P, N, K) and hessian (P, K, K), got"
            f" {tuple(weight.shape)}, {tuple(hessian.shape)}"
        )
    p, n_rows, k = weight.shape
    group_size = _check_quant_args(weight.reshape(p * n_rows, k), bits, group_size, "ls")
    workers = torch.get_num_threads()
    if weight.device.type == "cpu" and p > 1 and workers > 1:
        # small per-column ops: one Python thread per core, ops single-threaded (as `_quantize_ls`)
        step = -(-p // workers)
        parts: dict[int, QuantizedMatrix] = {}

        def run(start: int) -> None:
            stop = min(start + step, p)
            parts[start] = _gptq(weight[start:stop], hessian[start:stop], bits, group_size)

        _run_single_threaded_ops(run, list(range(0, p, step)))
        ordered = [parts[start] for start in sorted(parts)]
        return QuantizedMatrix(
            torch.cat([q.codes for q in ordered]),
            torch.cat([q.scale for q in ordered]),
            torch.cat([q.offset for q in ordered]),
            bits,
            group_size,
        )
    return _gptq(weight, hessian, bits, group_size)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int) -> QuantizedMatrix:
    p, n_rows, k = weight.shape
    qmax, tiny = 2**bits - 1, torch.finfo(PARAM_DTYPE).tiny
    w = weight.to(torch.float32).clone()
    h = hessian.to(w.device, torch.float64).clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    dead = diag <= 0
    diag.add_(GPTQ_DAMP * diag.clamp_min(0).mean(-1, keepdim=True) + dead.to(h.dtype))
    empty = diag.sum(-1) == dead.sum(-1)  # a matrix never selected: identity
    h[empty] = torch.eye(k, dtype=h.dtype, device=h.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    importance = torch.diagonal(h, dim1=-2, dim2=-1).to(torch.float32)[:, None, :]  # (P, 1, K)
    groups = k // group_size
    scale = torch.empty((p, n_rows, groups), dtype=torch.float32, device=w.device)
    offset = torch.empty_like(scale)
    # columns as contiguous rows: wt (P, K, N), so column j is wt[:, j] and its update is one axpy
    wt = w.transpose(1, 2).contiguous()
    codes_t = torch.empty((p, k, n_rows), dtype=torch.uint8, device=w.device)
    block = min(GPTQ_BLOCK, group_size)  # "lazy batch" updates: columns beyond a block by one bmm
    for b0 in range(0, k, block):
        b1 = b0 + block
        if b0 % group_size == 0:
            gi = b0 // group_size
            g1 = b0 + group_size
            s, o = _weighted_window(wt[:, b0:g1].transpose(1, 2), importance[:, :, b0:g1], bits, tiny)
            scale[:, :, gi], offset[:, :, gi] = s, o
            inv_s, o_s = 1.0 / s, -o / s
        errors = torch.empty((p, block, n_rows), dtype=torch.float32, device=w.device)
        for j in range(b0, b1):
            c = torch.addcmul(o_s, wt[:, j], inv_s).round_().clamp_(0, qmax)
            codes_t[:, j] = c.to(torch.uint8)
            e = (wt[:, j] - torch.addcmul(o, c, s)) / u[:, j, j, None]
            wt[:, j:b1] -= u[:, j, j:b1, None] * e[:, None, :]
            errors[:, j - b0] = e
        if b1 < k:
            wt[:, b1:] -= torch.bmm(u[:, b0:b1, b1:].transpose(1, 2), errors)
    codes = codes_t.transpose(1, 2)
    return QuantizedMatrix(
        codes.reshape(p * n_rows, k).contiguous(),
        scale.reshape(p * n_rows, groups).to(PARAM_DTYPE),
        offset.reshape(p * n_rows, groups).to(PARAM_DTYPE),
        bits,
        group_size,
    )


def _weighted_window(groups: torch.Tensor, importance: torch.Tensor, bits: int, tiny: float):
    """(scale, offset) (P, N) PARAM_DTYPE-rounded: the LS_CLIP_RATIOS window of each group (P, N, g)
    with the least `importance`-weighted (P, 1, g) squared error."""
    qmax = 2**bits - 1
    w_min, w_max = groups.amin(-1), groups.amax(-1)
    midpoint, width = (w_max + w_min) / 2, w_max - w_min
    best = None
    for ratio in LS_CLIP_RATIOS[bits]:
        s = _round_param((width * (ratio / qmax)).clamp_min(tiny))
        o = _round_param(midpoint - width * (ratio / 2))
        c = ((groups - o[..., None]) / s[..., None]).round().clamp(0, qmax)
        err = ((c * s[..., None] + o[..., None] - groups).square() * importance).sum(-1)
        if best is None:
            best = [s, o, err]
            continue
        better = err < best[2]
        best = [torch.where(better, new, old) for new, old in zip((s, o, err), best)]
    return best[0], best[1]


def dequantize_matrix(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """W_hat = codes * scale + offset, group-wise along K.

    codes (N, K) uint8; scale, offset (N, K // g) float16 -> (N, K) `dtype`. Computed in float32.
    """
    n_rows, k = codes.shape
    num_groups = scale.shape[-1]
    if k % num_groups:
        raise ValueError(f"K={k} is not a multiple of the number of groups {num_groups}")
    grouped = codes.reshape(n_rows, num_groups, k // num_groups).to(torch.float32)
    w_hat = torch.addcmul(offset.float().unsqueeze(-1), grouped, scale.float().unsqueeze(-1))
    return w_hat.reshape(n_rows, k).to(dtype)


def _check_quant_args(weight: torch.Tensor, bits: int, group_size: int | None, method: str) -> int:
    if bits not in DEFAULT_GROUP_SIZE:
        raise ValueError(f"bits must be one of {sorted(DEFAULT_GROUP_SIZE)}, got {bits}")
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {sorted(QUANT_METHODS)}, got {method!r}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {tuple(weight.shape)} {weight.dtype}")
    group_size = default_group_size(bits, weight.shape[1]) if group_size is None else group_size
    _check_group_size(weight.shape[1], group_size, bits)
    # NOTE: host sync; quantization is offline (checkpoint preparation), never on the decode path.
    if not bool(torch.isfinite(weight).all()) or float(weight.abs().max()) > torch.finfo(PARAM_DTYPE).max:
        raise ValueError("weight has non-finite values or values beyond float16 range; cannot quantize")
    return group_size


def default_group_size(bits: int, k: int, preferred: int | None = None) -> int:
    """`preferred` (default DEFAULT_GROUP_SIZE[bits]), halved while it does not divide K (down to
    MIN_DEFAULT_GROUP_SIZE).

    For example int2 on GPT-OSS's I=2880 (not a multiple of 128) gets 64. ValueError if none divides K.
    """
    if bits not in DEFAULT_GROUP_SIZE:
        raise ValueError(f"bits must be one of {sorted(DEFAULT_GROUP_SIZE)}, got {bits}")
    group_size = preferred or DEFAULT_GROUP_SIZE[bits]
    while k % group_size and group_size > MIN_DEFAULT_GROUP_SIZE:
        group_size //= 2
    if k % group_size:
        raise ValueError(f"no default group size divides K={k}; pass group_size explicitly")
    return group_size


def _check_group_size(k: int, group_size: int, bits: int) -> None:
    per_byte = 8 // bits
    if group_size <= 0 or group_size % per_byte:
        raise ValueError(
            f"group_size must be a positive multiple of {per_byte} for int{bits}, got {group_size}"
        )
    if k % group_size:
        raise ValueError(
            f"input dimension K={k} is not a multiple of group_size={group_size}; pick a divisor"
        )


def _as_groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) -> (N, K // group_size, group_size), a view."""
    n_rows, k = weight.shape
    return weight.reshape(n_rows, k // group_size, group_size)


def _min_max_params(
    groups: torch.Tensor, qmax: int, clip_ratio: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Range [min, max] of each group, shrunk about its midpoint by `clip_ratio`:
    offset = window start, scale = window width / qmax. groups (N, G, g) -> both (N, G, 1) float32,
    already rounded to PARAM_DTYPE so that codes are computed against the parameters actually stored."""
    w_min = groups.amin(dim=-1, keepdim=True)
    w_max = groups.amax(dim=-1, keepdim=True)
    half_width = (w_max - w_min) * (clip_ratio / 2)
    midpoint = (w_max + w_min) / 2
    # A constant group has width 0; the smallest normal float16 keeps the division finite and
    # still represents the group exactly (all codes 0, W_hat = offset).
    scale = (2 * half_width / qmax).clamp_min(torch.finfo(PARAM_DTYPE).tiny)
    return _round_param(scale), _round_param(midpoint - half_width)


def _mse_clipped_params(groups: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the CLIP_RATIOS window with the least squared error. groups (N, G, g) -> (N, G, 1) x 2."""
    best_scale, best_offset = _min_max_params(groups, qmax)
    best_error = _squared_error(groups, best_scale, best_offset, qmax)
    for clip_ratio in CLIP_RATIOS[1:]:
        scale, offset = _min_max_params(groups, qmax, clip_ratio)
        error = _squared_error(groups, scale, offset, qmax)
        improved = error < best_error
        best_scale = torch.where(improved, scale, best_scale)
        best_offset = torch.where(improved, offset, best_offset)
        best_error = torch.where(improved, error, best_error)
    return best_scale, best_offset


def _round_param(param: torch.Tensor) -> torch.Tensor:
    return param.to(PARAM_DTYPE).to(torch.float32)


def _codes_for(groups: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmax: int) -> torch.Tensor:
    return torch.round((groups - offset) / scale).clamp_(0, qmax).to(torch.uint8)


def _squared_error(
    groups: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmax: int
) -> torch.Tensor:
    """Per-group sum of squared dequantization error, (N, G, 1) float32."""
    return _squared_error_of(groups, _codes_for(groups, scale, offset, qmax), scale, offset)


def _squared_error_of(
    groups: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """Per-group sum of squared error of given codes, (N, G, 1) float32."""
    w_hat = codes.to(torch.float32) * scale + offset
    return (groups - w_hat).square().sum(dim=-1, keepdim=True)


def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Proximal operator of the l_p (p < 1) penalty, the generalized soft threshold of HQQ.

    sign(x) * relu(|x| - |x|^(p-1) / beta), which is nonzero only where |x| > beta^(-1 / (2 - p)).
    """
    magnitude = x.abs()
    # NOTE: host sync; offline only. Skips the costly pow when no element passes the threshold,
    # the usual case at expert-weight magnitudes.
    if not bool((magnitude > beta ** (-1.0 / (2.0 - p))).any()):
        return torch.zeros_like(x)
    threshold = magnitude.clamp_min(1e-12).pow(p - 1.0) / beta
    return torch.sign(x) * F.relu(magnitude - threshold)


def _hqq_refine_offset(
    groups: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmax: int
) -> torch.Tensor:
    """Half-quadratic splitting on the offset, scale fixed.

    Alternates (1) the sparse error term E = shrink(W - W_hat) for the current codes, (2) the
    closed-form offset minimizing ||W - E - (codes * scale + offset)||^2 per group, i.e. the group mean
    of W - E - codes * scale, (3) codes for the new offset. Keeps, per group, the best offset seen by
    squared error; stops early once no group improves.
    groups (N, G, g), scale and offset (N, G, 1) float32 -> offset (N, G, 1) float32.
    """
    codes = _codes_for(groups, scale, offset, qmax)
    best_offset, best_error = offset, _squared_error_of(groups, codes, scale, offset)
    beta = HQQ_BETA
    for _ in range(HQQ_ITERS):
        scaled_codes = codes.to(torch.float32) * scale
        sparse_error = _shrink_lp(groups - scaled_codes - offset, beta, HQQ_LP_NORM)
        offset = _round_param((groups - sparse_error - scaled_codes).mean(dim=-1, keepdim=True))
        codes = _codes_for(groups, scale, offset, qmax)
        error = _squared_error_of(groups, codes, scale, offset)
        improved = error < best_error
        # NOTE: host sync; offline only.
        if not bool(improved.any()):
            break
        best_offset = torch.where(improved, offset, best_offset)
        best_error = torch.where(improved, error, best_error)
        beta *= HQQ_KAPPA
    return best_offset
