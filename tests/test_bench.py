"""`moetide bench` on tiny checkpoints (CPU): files and fields written, counts and timings consistent,
online arrivals honoured, failing configurations recorded, relative budgets, trace replay forcing
the recorded experts."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from test_bad_input import assert_one_line_error, run_cli

from moetide.engine.memory import model_bytes, resolve_budget
from moetide.bench.replay import TraceReplay, TraceReplayError, trace_geometry_overrides, trace_requests
from moetide.bench.runs import drive_engine
from moetide.bench.stats import distribution, percentile
from moetide.bench.sweep import BenchSpec, run_sweep
from moetide.bench.synthetic import write_synthetic_checkpoint
from moetide.bench.workload import poisson_arrivals, read_arrivals_csv
from moetide.config import EngineConfig
from moetide.engine.llm import build_engine
from moetide.errors import ConfigError
from moetide.models.registry import get_adapter
from moetide.analysis.trace import Trace, record_trace

RUN_FIELDS = ("summary", "metrics", "requests", "budget_bytes", "plan", "peak_gpu_bytes", "machine", "config")
ROW_FIELDS = (
    "throughput_tok_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "tpot_p99_s",
    "e2e_mean_s",
    "e2e_p99_s",
    "hit_rate",
    "lo_run_rate",
    "bytes_h2d",
    "promotions",
    "demotions",
    "peak_gpu_bytes",
)
PNG = b"\x89PNG\r\n\x1a\n"


def small_spec(checkpoint, out, **kw) -> BenchSpec:
    base = dict(
        model=str(checkpoint),
        device="cpu",
        policies=["on-demand"],
        gpu_memory=["50%"],
        batch_sizes=[1],
        output_len=4,
        max_input_len=24,
        out=str(out),
    )
    return BenchSpec(**{**base, **kw})


def test_offline_sweep_writes_runs_summary_and_plots(qwen3_checkpoint, tmp_path):
    spec = small_spec(
        qwen3_checkpoint,
        tmp_path,
        policies=["on-demand", "lru"],
        batch_sizes=[1, 3],
        output_len=5,
        baselines=["hf"],
    )
    summary = run_sweep(spec, progress=False)
    rows = summary["runs"]
    assert [(r["engine"], r["policy"], r["batch_size"]) for r in rows] == [
        ("moetide", "on-demand", 1),
        ("moetide", "lru", 1),
        ("hf", "hf", 1),
        ("moetide", "on-demand", 3),
        ("moetide", "lru", 3),
        ("hf", "hf", 3),
    ]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    for row in rows:
        run = json.loads((tmp_path / "runs" / f"{row['name']}.json").read_text())
        bs = row["batch_size"]
        # every request produced exactly the tokens asked for, and the totals say so
        assert [r["output_len"] for r in run["requests"]] == [5] * bs
        assert run["summary"]["output_tokens"] == row["output_tokens"] == 5 * bs
        assert row["throughput_tok_s"] == pytest.approx(5 * bs / run["summary"]["duration_s"])
        for r in run["requests"]:
            assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0
            assert r["e2e_s"] == pytest.approx(r["ttft_s"] + 4 * r["tpot_s"], rel=1e-6, abs=1e-6)
        if row["engine"] == "moetide":
            for field in RUN_FIELDS:
                assert field in run, field
            for field in ROW_FIELDS:
                assert field in row, field
            assert 0.0 <= row["hit_rate"] <= 1.0 and row["bytes_h2d"] > 0  # a 50% budget must move experts
            m = run["metrics"]
            assert m["experts_used"] == m["hits"] + m["lo_runs"] + m["misses"]
            assert run["budget_bytes"] == row["budget_bytes"] > 0
            # the run's recorded spec says what ran, not the sweep's default engine
            engine = run["config"]["spec"]["engine"]
            assert (engine["policy"], engine["gpu_memory_bytes"]) == (row["policy"], row["budget_bytes"])
            assert engine["max_num_seqs"] == bs
            d = run["summary"]["ttft_s"]
            assert d["p50"] <= d["p90"] <= d["p99"] and d["n"] == bs
    summary_file = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary_file["runs"]) == 6 and summary_file["machine"]["torch"] == torch.__version__
    table = (tmp_path / "summary.md").read_text()
    assert table.count("| bs00") == 6
    for name in ("throughput.png", "tpot.png", "hit_rate.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_a_failing_configuration_is_recorded_and_the_sweep_goes_on(qwen3_checkpoint, tmp_path, capsys):
    spec = small_spec(qwen3_checkpoint, tmp_path, gpu_memory=["1MiB", "60%"])
    rows = run_sweep(spec, progress=True)["runs"]
    # stderr is not a terminal here: no progress bar, one plain line, then one line per run
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("[moetide] bench: writing to") == 1, err
    assert len(rows) == 2
    assert rows[0]["error"] and "too small" in rows[0]["error"] and "\n" not in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["output_tokens"] == 4
    assert "error" in json.loads((tmp_path / "runs" / f"{rows[0]['name']}.json").read_text())


def test_online_mode_follows_the_arrival_csv(qwen3_checkpoint, tmp_path):
    csv = tmp_path / "arrivals.csv"
    csv.write_text("arrival_s,input_len,output_len\n0.0,10,3\n0.25,17,5\n0.05,6,2\n0.6,12,4\n")
    spec = small_spec(
        qwen3_checkpoint,
        tmp_path / "out",
        mode="online",
        arrivals=str(csv),
        batch_sizes=[2],
        policies=["on-demand"],
    )
    row = run_sweep(spec, progress=False)["runs"][0]
    assert row["error"] is None
    run = json.loads((tmp_path / "out" / "runs" / f"{row['name']}.json").read_text())
    reqs = sorted(run["requests"], key=lambda r: r["arrival_s"])
    assert [round(r["arrival_s"], 6) for r in reqs] == [0.0, 0.05, 0.25, 0.6]
    assert [(r["prompt_len"], r["output_len"]) for r in reqs] == [(10, 3), (6, 2), (17, 5), (12, 4)]
    assert run["summary"]["output_tokens"] == 14
    # a request cannot finish before it arrives, and the run lasts at least until the last arrival
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in reqs)
    assert run["summary"]["duration_s"] >= 0.6 + reqs[-1]["e2e_s"] - 1e-6


def test_online_poisson_and_spec_errors(qwen3_checkpoint, tmp_path):
    times = poisson_arrivals(2000, rate_per_s=8.0, seed=3)
    assert times == sorted(times) and 2000 / times[-1] == pytest.approx(8.0, rel=0.1)
    with pytest.raises(ConfigError, match="exactly one of --rate"):
        small_spec(qwen3_checkpoint, tmp_path, mode="online")
    with pytest.raises(ConfigError, match="batch 1"):
        small_spec(qwen3_checkpoint, tmp_path, trace="x", batch_sizes=[4])
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_len,output_len\n0.1,abc,3\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_arrivals_csv(bad)


def test_stats_match_numpy_percentiles():
    import numpy as np

    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.5, 0.05]
    for q in (50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    d = distribution([None, 1.0, 3.0])
    assert d["mean"] == 2.0 and d["n"] == 2
    assert distribution([None])["mean"] is None and math.isnan(percentile([], 50))


def test_relative_budget_is_the_fixed_part_plus_a_share_of_the_experts(qwen3_checkpoint):
    config = EngineConfig(
        model=str(qwen3_checkpoint),
        device="cpu",
        policy="on-demand",
        max_num_seqs=2,
        max_model_len=64,
        kv_cache_tokens=128,
    )
    mb = model_bytes(config)
    budget = resolve_budget("25%", config)
    assert budget == mb.fixed.total + int(0.25 * mb.all_experts_hi_bytes)
    assert resolve_budget("4MiB", config) == 4 << 20 and resolve_budget("none", config) is None
    import dataclasses

    loaded, _, _ = build_engine(dataclasses.replace(config, gpu_memory_bytes=budget), progress=False)
    plan = loaded.runtime.residency.plan
    assert plan.fixed == mb.fixed  # computed without loading = what the residency core computed
    assert plan.hi_slots == mb.num_experts_total // 4
    loaded.runtime.residency.close()


# -- trace replay -------------------------------------------------------------------------------------------
PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42], [11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def recorded(tiny_checkpoints, tmp_path_factory):
    """A trace recorded on the tiny Qwen3-MoE, saved, and its path."""
    _, model = tiny_checkpoints["qwen3_moe"]
    trace = record_trace(model, get_adapter("qwen3_moe"), PROMPTS, 5, spec_distances=(1,))
    path = tmp_path_factory.mktemp("trace") / "tiny.safetensors"
    trace.save(path)
    return trace, path


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """A checkpoint of the same geometry as the traced one, different weights (so different routing)."""
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("qwen3_other")
    save_tiny_model("qwen3_moe", path, seed=7)
    return path


def _capture_expert_inputs(loaded):
    """Forward pre-hooks on each managed experts module: the (T, k) ids it is asked to compute."""
    seen: list[list[torch.Tensor]] = [[] for _ in loaded.moe_layers]
    handles = []
    for ordinal, idx in enumerate(loaded.moe_layers):
        experts = loaded.model.model.layers[idx].mlp.experts
        handles.append(
            experts.register_forward_pre_hook(
                lambda _m, args, o=ordinal: seen[o].append(args[1].detach().clone())
            )
        )
    return seen, handles


def test_replay_feeds_each_request_its_recorded_prompt(recorded, tiny_checkpoints):
    """The recording stores prompts in recording order; replay finds each by its request id, also
    when the recording's request ids did not start at 0."""
    trace, _ = recorded
    requests, _ = trace_requests(trace, 96)
    assert [list(r.prompt_ids) for r in requests] == PROMPTS
    _, model = tiny_checkpoints["qwen3_moe"]
    shifted = record_trace(model, get_adapter("qwen3_moe"), PROMPTS, 3, spec_distances=(), request_id_start=7)
    assert shifted.requests() == [7, 8, 9]
    requests, _ = trace_requests(shifted, 96)
    assert [list(r.prompt_ids) for r in requests] == PROMPTS
    # a selection keeps the ids: requests 9 and 7, in that order, get prompts 2 and 0
    requests, _ = trace_requests(shifted.select_requests([9, 7]), 96)
    assert [list(r.prompt_ids) for r in requests] == [PROMPTS[2], PROMPTS[0]]


def test_record_trace_honours_the_prompts_file(qwen3_checkpoint, tmp_path, capsys):
    from moetide.bench.workload import text_prompts
    from moetide.cli import main
    from moetide.models.checkpoint import load_tokenizer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the first prompt\nanother one, a little longer than the first\n")
    out = tmp_path / "trace.safetensors"
    args = ["--num-prompts", "2", "--output-len", "3", "--max-input-len", "32"]
    model = ["--model", str(qwen3_checkpoint)]
    assert main(["bench", *model, "--record-trace", str(out), "--prompts", str(prompts), *args]) == 0
    trace = Trace.load(out)
    want = text_prompts(load_tokenizer(qwen3_checkpoint), 2, 32, str(prompts))
    assert trace.meta.extra["prompt_ids"] == want and trace.meta.extra["prompts_file"] == str(prompts)
    assert [len(trace.step(s).topk_ids) for s in range(len(trace)) if trace.step(s).kind == "prefill"] == [
        len(p) for p in want
    ]


def test_replay_forces_the_recorded_experts(recorded, other_weights):
    trace, _ = recorded
    # lru speculates one layer ahead: router 1 applied to router 0's input, which the trace recorded
    config = EngineConfig(
        model=str(other_weights),
        device="cpu",
        policy="lru",
        max_num_seqs=1,
        max_model_len=64,
        prefetch_distance=1,
    )
    # half the experts in hi: a cap that held them all would run with no policy
    config = dataclasses.replace(config, gpu_memory_bytes=resolve_budget("50%", config))
    loaded, engine, _ = build_engine(config, progress=False)
    requests, ordered = trace_requests(trace, loaded.config.vocab_size)
    assert [len(r.prompt_ids) for r in requests] == [len(p) for p in PROMPTS]
    assert sum(r.output_len for r in requests) == len(trace)

    seen, handles = _capture_expert_inputs(loaded)
    drive_engine(engine, requests, closed_loop=True)  # without replay: the model's own routing
    own = [torch.cat(s) for s in seen]
    for s in seen:
        s.clear()
    replay = TraceReplay(loaded.model, loaded.adapter, ordered)
    drive_engine(engine, requests, closed_loop=True)
    forced = [torch.cat(s) for s in seen]
    for h in handles:
        h.remove()
    recorded_ids = ordered.topk_ids.long()  # (N, L, k)
    for layer in range(trace.meta.num_layers):
        assert torch.equal(forced[layer], recorded_ids[:, layer]), layer
    assert not all(torch.equal(own[l], recorded_ids[:, l]) for l in range(trace.meta.num_layers))
    stats = replay.stats()
    assert (
        stats["steps_replayed"] == len(trace)
        and stats["router_calls_forced"] == len(trace) * trace.meta.num_layers
    )
    assert stats["speculative_forced"] > 0 and stats["speculative_unrecorded"] == 0
    replay.remove()
    loaded.policy.close()
    loaded.runtime.residency.close()


def test_trace_mode_of_the_sweep_replays_every_step(recorded, other_weights, tmp_path):
    trace, path = recorded
    spec = BenchSpec(
        model=str(other_weights),
        device="cpu",
        policies=["on-demand"],
        gpu_memory=["40%"],
        trace=str(path),
        trace_warmup=1,
        out=str(tmp_path),
    )
    row = run_sweep(spec, progress=False)["runs"][0]
    assert row["error"] is None
    run = json.loads((tmp_path / "runs" / f"{row['name']}.json").read_text())
    assert run["replay"]["steps_replayed"] == len(trace)
    first = len(trace.select_requests([trace.requests()[0]]))  # the warm-up request's steps
    assert run["summary"]["output_tokens"] == len(trace) - first
    # on-demand uses exactly the distinct experts of each measured step and layer
    ordered = trace.select_requests(trace.requests())
    used = sum(
        int(torch.unique(ordered.step(s).layer_topk(l)).numel())
        for s in range(first, len(ordered))
        for l in range(trace.meta.num_layers)
    )
    assert run["metrics"]["experts_used"] == used


def test_trace_replay_prefills_a_prompt_with_a_cached_prefix_whole(tiny_checkpoints, other_weights, tmp_path):
    """Replayed prompts that share two KV blocks of prefix: the replay turns the prefix cache off, so
    the second prompt prefills all its tokens, as the trace's step recorded them."""
    _, model = tiny_checkpoints["qwen3_moe"]
    shared = list(range(5, 5 + 40))
    prompts = [shared + [60, 61], shared + [70, 71, 72]]
    trace = record_trace(model, get_adapter("qwen3_moe"), prompts, 3, spec_distances=())
    path = tmp_path / "shared.safetensors"
    trace.save(path)
    spec = BenchSpec(model=str(other_weights), device="cpu", policies=["lru"], gpu_memory=["40%"],
                     trace=str(path), trace_warmup=1, out=str(tmp_path / "out"))  # fmt: skip
    row = run_sweep(spec, progress=False)["runs"][0]
    assert row["error"] is None, row["error"]
    run = json.loads((tmp_path / "out" / "runs" / f"{row['name']}.json").read_text())
    assert run["replay"]["steps_replayed"] == len(trace)


def test_replay_onto_a_synthetic_shape_with_the_traces_geometry(recorded, tmp_path):
    trace, _ = recorded
    small = dict(
        hidden_size=32,
        intermediate_size=24,
        vocab_size=96,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    path = write_synthetic_checkpoint(
        "olmoe-1b-7b", tmp_path / "syn", progress=False, **small, **trace_geometry_overrides("olmoe", trace)
    )
    config = EngineConfig(model=str(path), device="cpu", policy="on-demand", max_num_seqs=1, max_model_len=64)
    loaded, engine, _ = build_engine(config, progress=False)
    requests, ordered = trace_requests(trace, loaded.config.vocab_size)
    replay = TraceReplay(loaded.model, loaded.adapter, ordered)
    seen, _ = _capture_expert_inputs(loaded)
    drive_engine(engine, requests, closed_loop=True)
    for layer in range(trace.meta.num_layers):
        assert torch.equal(torch.cat(seen[layer]), ordered.topk_ids.long()[:, layer])
    with pytest.raises(TraceReplayError, match="all were replayed"):
        drive_engine(engine, requests[:1], closed_loop=True)
    replay.remove()
    loaded.runtime.residency.close()
    # the shape without the trace's geometry is refused, not silently mis-replayed
    wrong = write_synthetic_checkpoint(
        "olmoe-1b-7b", tmp_path / "wrong", progress=False, **small, num_hidden_layers=2
    )
    loaded, _, _ = build_engine(EngineConfig(model=str(wrong), device="cpu"), progress=False)
    with pytest.raises(TraceReplayError, match="model has 2 x 64, top-8"):
        TraceReplay(loaded.model, loaded.adapter, trace)


def test_bench_cli_end_to_end(qwen3_checkpoint, tmp_path):
    proc = run_cli(
        "bench",
        "--model",
        str(qwen3_checkpoint),
        "--device",
        "cpu",
        "--policy",
        "on-demand,combined:lo",
        "--gpu-memory",
        "60%",
        "--output-len",
        "3",
        "--max-input-len",
        "16",
        "--hi",
        "int4",
        "--lo-kernel",
        "dequant",
        "--cuda-graphs",
        "off",
        "--searcher",
        "thread",
        "--prefetch-distance",
        "1",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert [r["policy"] for r in rows] == ["on-demand", "combined:lo"] and all(
        r["error"] is None for r in rows
    )
    assert rows[1]["lo_runs"] > 0  # combined:lo ran misses on resident lo versions
    # the engine options given to `moetide bench` reach every run's engine
    run = json.loads((tmp_path / "runs" / f"{rows[1]['name']}.json").read_text())
    assert run["engine_options"] == {
        "on_miss": "lo",
        "prefetch_distance": 1,
        "hi_precision": "int4",
        "ladder": None,
        "host_versions": None,
        "lo_kernel": "dequant",
        "cuda_graphs": "off",
        "searcher": "thread",
        "moe_kernel": "reference",
    }
    assert run["cuda_graph_stats"] is None  # off (and a CPU run has no graphs either)
    proc = run_cli("bench", "--model", str(qwen3_checkpoint), "--mode", "online", "--out", str(tmp_path))
    assert_one_line_error(proc, "--rate")
    proc = run_cli("bench", "--model", str(qwen3_checkpoint), "--policy", "fastest", "--out", str(tmp_path))
    assert_one_line_error(proc, "unknown policy 'fastest'")


@pytest.mark.gpu
def test_bench_and_replay_on_cuda(recorded, other_weights, tmp_path):
    """The CUDA path: bf16, copy streams, peak-memory counter, replay tensors on the device."""
    trace, path = recorded
    spec = small_spec(
        other_weights,
        tmp_path / "offline",
        device="cuda",
        policies=["on-demand", "combined"],
        batch_sizes=[1, 4],
        baselines=["hf"],
    )
    rows = run_sweep(spec, progress=False)["runs"]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    for r in rows:
        assert r["output_tokens"] == 4 * r["batch_size"] and r["peak_gpu_bytes"] > 0
    spec = BenchSpec(
        model=str(other_weights),
        device="cuda",
        policies=["lru", "finemoe"],
        gpu_memory=["40%"],
        trace=str(path),
        trace_warmup=1,
        out=str(tmp_path / "trace"),
    )
    rows = run_sweep(spec, progress=False)["runs"]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    run = json.loads((tmp_path / "trace" / "runs" / f"{rows[0]['name']}.json").read_text())
    assert run["replay"]["steps_replayed"] == len(trace) and run["replay"]["speculative_unrecorded"] == 0


def test_bench_moetide_records_every_decode_step(qwen3_checkpoint):
    from moetide.bench.runs import bench_moetide

    r = bench_moetide(qwen3_checkpoint, "on-demand", "64MiB", new_tokens=6, device="cpu", prompt_len=8)
    steps = r["decode_step_ms"]
    assert r["decode_tok_s"] > 0 and len(steps["all"]) >= 5
    assert 0 < steps["min"] <= steps["p50"] <= steps["max"]
