"""Expert weight formats (moetide.store.quant): quantize, pack, buffers, an expert's forward from them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.store import quant
from moetide.store.quant import (
    ALIGN_BYTES,
    PARAM_DTYPE,
    dequantize,
    dequantize_matrix,
    expert_layout,
    expert_views,
    nbytes_for,
    pack,
    pack_expert,
    quantize,
    swiglu_expert,
    unpack,
)

# Bounds from docs/quantization.md (OLMoE-shaped experts, Gaussian weights std 0.02, default group
# sizes and method): weight error int4 0.084 / int2 0.337, output error int4 0.147 / int2 0.552.
# The tests use smaller experts, so they allow about 20-30 % for sampling spread. Plain min/max RTN
# exceeds the int2 output bound (measured 1.02 at group 128).
WEIGHT_ERROR_BOUND = {4: 0.10, 2: 0.38}
OUTPUT_ERROR_BOUND = {4: 0.19, 2: 0.66}

DTYPES = (torch.bfloat16, torch.float32)
FAST = settings(max_examples=25, deadline=None)


def gaussian(shape, dtype=torch.float32, seed=0, std=0.02):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * std).to(dtype)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


def random_expert(intermediate, hidden, dtype, seed=0):
    return gaussian((2 * intermediate, hidden), dtype, seed), gaussian(
        (hidden, intermediate), dtype, seed + 1
    )


# ---------------------------------------------------------------------------------------------
# pack / unpack
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    bits=st.sampled_from([4, 2]),
    rows=st.integers(1, 5),
    bytes_per_row=st.integers(1, 40),
    seed=st.integers(0, 99),
)
def test_unpack_inverts_pack(bits, rows, bytes_per_row, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(
        0, 2**bits, (rows, bytes_per_row * 8 // bits), generator=generator, dtype=torch.uint8
    )
    packed = pack(codes, bits)
    assert packed.shape == (rows, bytes_per_row) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


@FAST
@given(bits=st.sampled_from([4, 2]), numel=st.integers(1, 64), seed=st.integers(0, 99))
def test_pack_inverts_unpack(bits, numel, seed):
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (3, numel), generator=generator, dtype=torch.uint8)
    assert torch.equal(pack(unpack(packed, bits), bits), packed)


def test_pack_layout_is_little_end_first():
    """The Triton kernel relies on this exact bit layout."""
    assert pack(torch.tensor([[0x1, 0x2]], dtype=torch.uint8), 4).item() == 0x21
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).item() == 0b00_11_10_01


def test_pack_rejects_codes_out_of_range_and_bad_widths():
    with pytest.raises(ValueError):
        pack(torch.tensor([[16, 0]], dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        pack(torch.zeros(1, 3, dtype=torch.uint8), 2)
    with pytest.raises(ValueError):
        pack(torch.zeros(1, 8, dtype=torch.uint8), 3)


# ---------------------------------------------------------------------------------------------
# quantize / dequantize one matrix
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    bits=st.sampled_from([4, 2]),
    group_size=st.sampled_from([32, 64, 128]),
    rows=st.integers(1, 6),
    groups=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 99),
)
def test_rtn_error_is_at_most_half_a_step(bits, group_size, rows, groups, dtype, seed):
    weight = gaussian((rows, groups * group_size), dtype, seed)
    q = quantize(weight, bits, group_size, method="rtn")
    assert q.codes.shape == weight.shape and q.codes.dtype == torch.uint8
    # float16, not bfloat16: the schema the kernels read (docs/quantization.md measures why).
    assert q.scale.shape == q.offset.shape == (rows, groups)
    assert q.scale.dtype == q.offset.dtype == PARAM_DTYPE == torch.float16
    assert int(q.codes.max()) <= 2**bits - 1
    w_hat = dequantize_matrix(q.codes, q.scale, q.offset, torch.float32)
    error = (weight.float() - w_hat).abs().reshape(rows, groups, group_size)
    # The float16 rounding of scale and offset may push the top of the range past the last level by
    # a few units in the last place of the parameters.
    half_step = q.scale.float().unsqueeze(-1) / 2
    slack = 2**-10 * (q.scale.float() * (2**bits - 1) + q.offset.float().abs()).unsqueeze(-1)
    assert bool((error <= half_step + slack).all())


@FAST
@given(
    bits=st.sampled_from([4, 2]),
    group_size=st.sampled_from([32, 64]),
    rows=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 99),
    std=st.sampled_from([0.02, 1.0]),  # at std 1 HQQ's sparse error term is nonzero
)
def test_refined_methods_never_raise_group_error(bits, group_size, rows, dtype, seed, std):
    """Each refinement keeps per group the better parameters: hqq <= mse <= rtn, group by group."""
    weight = gaussian((rows, 4 * group_size), dtype, seed, std).float()

    def group_sq_error(method):
        q = quantize(weight, bits, group_size, method)
        w_hat = dequantize_matrix(q.codes, q.scale, q.offset, torch.float32)
        return (weight - w_hat).square().reshape(rows, 4, group_size).sum(-1)

    rtn, mse, hqq = (group_sq_error(m) for m in ("rtn", "mse", "hqq"))
    tolerance = 1e-6 * rtn.max()
    assert bool((mse <= rtn + tolerance).all()) and bool((hqq <= mse + tolerance).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
def test_default_quantization_error_within_measured_bound(bits, dtype):
    weight = gaussian((512, 1024), dtype, seed=bits)
    q = quantize(weight, bits)
    error = relative_error(dequantize_matrix(q.codes, q.scale, q.offset, torch.float32), weight)
    assert error < WEIGHT_ERROR_BOUND[bits]
    # Refinement must matter: min/max RTN is measurably worse than the default method.
    rtn = quantize(weight, bits, q.group_size, method="rtn")
    assert relative_error(dequantize_matrix(rtn.codes, rtn.scale, rtn.offset, torch.float32), weight) > error


def test_constant_group_is_exact():
    weight = torch.full((2, 64), 0.375)
    weight[1] = -1.5
    q = quantize(weight, 2, 32, method="hqq")
    assert torch.equal(dequantize_matrix(q.codes, q.scale, q.offset, torch.float32), weight)


def test_group_far_from_zero_keeps_its_resolution():
    """The offset form does not lose a group whose values all sit far from zero."""
    weight = 100.0 + gaussian((4, 64), torch.float32, std=1.0)
    q = quantize(weight, 4, 64, method="rtn")
    assert (
        relative_error(dequantize_matrix(q.codes, q.scale, q.offset, torch.float32) - 100, weight - 100) < 0.2
    )


@pytest.mark.parametrize(
    "weight, bits, group_size",
    [
        (torch.zeros(4, 96), 4, 64),  # K not a multiple of the group size
        (torch.zeros(4, 64), 3, 32),  # unsupported width
        (torch.full((4, 64), float("nan")), 4, 32),
        (torch.full((4, 64), 1e5), 4, 32),  # beyond float16 range
        (torch.zeros(4, 64, dtype=torch.int32), 4, 32),
        (torch.zeros(64), 4, 32),
    ],
)
def test_quantize_rejects_bad_input(weight, bits, group_size):
    with pytest.raises(ValueError):
        quantize(weight, bits, group_size)


def test_default_group_size_halves_to_a_divisor():
    assert quant.default_group_size(2, 2880) == 64  # GPT-OSS intermediate size
    assert quant.default_group_size(4, 1024) == quant.DEFAULT_GROUP_SIZE[4]
    with pytest.raises(ValueError):
        quant.default_group_size(4, 1000)


# ---------------------------------------------------------------------------------------------
# Flat expert buffers
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    precision=st.sampled_from(["hi", "bf16", "int4", "int2+4", "int2"]),
    i_groups=st.integers(1, 6),
    h_groups=st.integers(1, 6),
    group_size=st.sampled_from([16, 32, 64]),
    dtype=st.sampled_from(DTYPES),
)
def test_layout_slots_are_aligned_disjoint_and_in_bounds(precision, i_groups, h_groups, group_size, dtype):
    intermediate, hidden = i_groups * group_size, h_groups * group_size
    meta = expert_layout(precision, intermediate, hidden, dtype, group_size)
    assert ALIGN_BYTES % 16 == 0  # kernels use 16-byte vector loads from slot starts
    assert meta.nbytes == nbytes_for(precision, intermediate, hidden, dtype, group_size)
    assert meta.nbytes % ALIGN_BYTES == 0
    end = 0
    for slot in meta.slots:
        assert slot.offset_bytes % ALIGN_BYTES == 0 and slot.offset_bytes >= end
        end = slot.offset_bytes + slot.nbytes
    assert end <= meta.nbytes < end + ALIGN_BYTES
    payload = sum(slot.nbytes for slot in meta.slots)
    if meta.is_low_bit:
        packed = intermediate * hidden * (2 * meta.bits_gate_up + meta.bits_down) // 8
        params = 2 * 2 * (2 * intermediate * hidden // group_size + hidden * intermediate // group_size)
        assert payload == packed + params
    else:
        assert payload == 3 * intermediate * hidden * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("precision", ["hi", "int4", "int2"])
def test_views_alias_the_buffer(precision):
    gate_up, down = random_expert(64, 128, torch.bfloat16)
    buffer, meta = pack_expert(gate_up, down, precision, group_size=32)
    assert buffer.shape == (meta.nbytes,) and buffer.dtype == torch.uint8
    views = expert_views(buffer, meta)
    base = buffer.data_ptr()
    for slot in meta.slots:
        view = views[slot.name]
        assert view.data_ptr() == base + slot.offset_bytes
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert tuple(view.shape) == slot.shape and view.dtype == slot.dtype and view.is_contiguous()
    # A write through a view is visible in the buffer: no copy was made.
    first = meta.slots[0]
    views[first.name].view(torch.uint8).view(-1)[0] = 0xAB
    assert int(buffer[first.offset_bytes]) == 0xAB


def test_pack_expert_writes_into_a_given_arena_slice():
    gate_up, down = random_expert(64, 128, torch.bfloat16)
    meta = expert_layout("int4", 64, 128, torch.bfloat16, 32)
    arena = torch.zeros(3 * meta.nbytes, dtype=torch.uint8)
    slot = arena[meta.nbytes : 2 * meta.nbytes]
    buffer, _ = pack_expert(gate_up, down, "int4", group_size=32, out=slot)
    assert buffer.data_ptr() == slot.data_ptr()
    standalone, _ = pack_expert(gate_up, down, "int4", group_size=32)
    assert torch.equal(arena[meta.nbytes : 2 * meta.nbytes], standalone)
    assert (
        int(arena[: meta.nbytes].count_nonzero()) == 0 and int(arena[2 * meta.nbytes :].count_nonzero()) == 0
    )


def test_expert_views_rejects_a_short_buffer():
    meta = expert_layout("int2", 64, 128, torch.bfloat16, 32)
    with pytest.raises(ValueError):
        expert_views(torch.empty(meta.nbytes - 1, dtype=torch.uint8), meta)


def test_pack_expert_rejects_mismatched_matrices():
    gate_up, down = random_expert(64, 128, torch.bfloat16)
    with pytest.raises(ValueError):
        pack_expert(gate_up, down.T.contiguous(), "int4")
    with pytest.raises(ValueError):
        pack_expert(gate_up, down.float(), "hi")
    with pytest.raises(ValueError):
        pack_expert(gate_up, down, "int3")


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_lo_buffer_holds_exactly_the_quantized_matrices(precision):
    bits = quant.LOW_BIT_PRECISIONS[precision]
    gate_up, down = random_expert(64, 128, torch.float32, seed=3)
    buffer, meta = pack_expert(gate_up, down, precision, group_size=(64, 32), quant_method="mse")
    assert (meta.group_size_gate_up, meta.group_size_down, meta.bits) == (64, 32, bits)
    views = expert_views(buffer, meta)
    for name, weight, group_size in (("gate_up", gate_up, 64), ("down", down, 32)):
        q = quantize(weight, bits, group_size, method="mse")
        assert torch.equal(views[f"{name}_packed"], pack(q.codes, bits))
        assert torch.equal(views[f"{name}_scale"], q.scale) and torch.equal(views[f"{name}_offset"], q.offset)
    gate_up_hat, down_hat = dequantize(views, meta, torch.float32)
    assert gate_up_hat.shape == gate_up.shape and down_hat.shape == down.shape


# ---------------------------------------------------------------------------------------------
# Expert forward
# ---------------------------------------------------------------------------------------------


def expert_forward(x, views, meta):
    """One expert's output (T, H) for x (T, H) from a packed version: dequantize to x's dtype, then
    `quant.swiglu_expert` (the reference formula the engine's kernels are compared with)."""
    return swiglu_expert(x, *dequantize(views, meta, x.dtype))


def reference_expert(x, gate_up, down):
    """The checkpoint formula, written out independently of quant.swiglu_expert."""
    intermediate = gate_up.shape[0] // 2
    gate = x @ gate_up[:intermediate].T
    up = x @ gate_up[intermediate:].T
    return (torch.nn.functional.silu(gate) * up) @ down.T


@pytest.mark.parametrize("dtype", DTYPES)
def test_hi_forward_equals_the_reference_formula_exactly(dtype):
    gate_up, down = random_expert(96, 64, dtype)
    buffer, meta = pack_expert(gate_up, down, "bf16")
    views = expert_views(buffer, meta)
    assert torch.equal(views["gate_up"], gate_up) and torch.equal(views["down"], down)
    x = gaussian((5, 64), dtype, seed=7, std=1.0)
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    expected = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)
    assert torch.equal(expert_forward(x, views, meta), expected)
    assert torch.allclose(
        expert_forward(x.double(), views, meta), reference_expert(x.double(), gate_up.double(), down.double())
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_lo_forward_error_within_measured_bound(precision, dtype):
    bits = quant.LOW_BIT_PRECISIONS[precision]
    gate_up, down = random_expert(256, 512, dtype, seed=bits)
    x = gaussian((64, 512), dtype, seed=11, std=1.0)
    buffer, meta = pack_expert(gate_up, down, precision)
    views = expert_views(buffer, meta)
    y = expert_forward(x, views, meta)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, swiglu_expert(x, *dequantize(views, meta, dtype)))
    exact = reference_expert(x.double(), gate_up.double(), down.double())
    assert relative_error(y, exact) < OUTPUT_ERROR_BOUND[bits]
    # The bound is not vacuous: an expert of the wrong weights is far outside it.
    other_up, other_down = random_expert(256, 512, dtype, seed=bits + 50)
    assert relative_error(reference_expert(x.double(), other_up.double(), other_down.double()), exact) > 1.0


# ---------------------------------------------------------------------------------------------
# GPU: CUDA results equal CPU ones
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["hi", "int4", "int2"])
def test_cuda_packing_matches_cpu(precision):
    gate_up, down = random_expert(128, 256, torch.bfloat16, seed=5)
    # "rtn" is elementwise IEEE arithmetic plus min/max: bit-identical on both devices.
    cpu_buffer, meta = pack_expert(gate_up, down, precision, quant_method="rtn")
    cuda_buffer, cuda_meta = pack_expert(gate_up.cuda(), down.cuda(), precision, quant_method="rtn")
    assert cuda_meta == meta and torch.equal(cuda_buffer.cpu(), cpu_buffer)
    # The refined default also averages over groups, where summation order may differ in the last
    # place; what must agree is the result's quality.
    cpu_buffer, meta = pack_expert(gate_up, down, precision)
    cuda_buffer, _ = pack_expert(gate_up.cuda(), down.cuda(), precision)
    for cpu_w, cuda_w, exact in zip(
        dequantize(expert_views(cpu_buffer, meta), meta, torch.float32),
        dequantize(expert_views(cuda_buffer.cpu(), meta), meta, torch.float32),
        (gate_up, down),
    ):
        assert relative_error(cuda_w, exact) == pytest.approx(relative_error(cpu_w, exact), rel=1e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["hi", "int4", "int2"])
def test_cuda_forward_matches_cpu(precision):
    gate_up, down = random_expert(128, 256, torch.bfloat16, seed=5)
    buffer, meta = pack_expert(gate_up, down, precision)
    cpu_views, cuda_views = expert_views(buffer, meta), expert_views(buffer.cuda(), meta)
    # Dequantize from the same bytes: an FMA on one device against a multiply-add on the other may
    # differ by one float32 rounding, far below the weights' 1e-2 scale.
    for cpu_w, cuda_w in zip(
        dequantize(cpu_views, meta, torch.float32), dequantize(cuda_views, meta, torch.float32)
    ):
        torch.testing.assert_close(cuda_w.cpu(), cpu_w, rtol=1e-6, atol=1e-8)
    x = gaussian((8, 256), torch.bfloat16, seed=9, std=1.0)
    y_cpu = expert_forward(x, cpu_views, meta).float()
    y_cuda = expert_forward(x.cuda(), cuda_views, meta).float().cpu()
    assert relative_error(y_cuda, y_cpu) < 1e-2  # bf16 matmuls: accumulation order differs


def test_row_chunking_never_changes_the_least_squares_result(monkeypatch):
    """The "ls" chunk size (QUANT_CHUNK_ELEMENTS on the CPU, QUANT_CHUNK_ELEMENTS_GPU on a GPU) only
    bounds memory: one chunk and many give the same codes and parameters."""
    from moetide.store import quant as q

    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    monkeypatch.setattr(q, "QUANT_CHUNK_ELEMENTS", 1 << 30)
    whole = q.quantize(weight, 2, 128, "ls")
    monkeypatch.setattr(q, "QUANT_CHUNK_ELEMENTS", 256 * 8)
    chunked = q.quantize(weight, 2, 128, "ls")
    for a, b in zip(whole[:3], chunked[:3]):
        assert torch.equal(a, b)
