"""The CLI end to end on a tiny checkpoint: streamed text, one summary line, info."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from test_bad_input import run_cli, run_cli_process

from moetide.policies.expert_map import ExpertMapStore


def test_generate_streams_and_summarises(qwen3_checkpoint):
    """The console entry point, in its own process."""
    proc = run_cli_process(
        "generate",
        "--model",
        str(qwen3_checkpoint),
        "--device",
        "cpu",
        "--max-tokens",
        "9",
        "--quiet",
        "--raw",
        "hello",
    )
    assert proc.returncode == 0, proc.stderr
    summary = [l for l in proc.stderr.splitlines() if l.startswith("[moetide]")]
    assert len(summary) == 1
    line = summary[0]
    assert re.search(r"prompt \d+ tok", line) and "output 9 tok" in line
    for field in ("TTFT", "TPOT", "tok/s", "experts moved"):
        assert field in line
    assert proc.stdout.strip() != ""


def test_info_reports_geometry(tiny_checkpoints):
    path, model = tiny_checkpoints["mixtral"]
    proc = run_cli("info", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Mixtral (mixtral)" in out
    assert "8 per layer, top-2" in out
    assert "2 with experts" in out
    total = sum(p.numel() for p in model.parameters())
    assert f"{total / 1e6:,.1f} M total" in out
    for precision in ("bf16", "int4", "int2"):
        assert precision in out


# -- streaming text --------------------------------------------------------------------------------------
def test_text_stream_holds_back_incomplete_utf8_on_the_demo_tokenizer():
    """Chinese, Russian, accented Latin and emoji take several byte-level tokens per character: the
    stream prints each character once it is whole, and what it prints is exactly the final text."""
    from moetide.engine.detokenize import TextStream, stable_prefix
    from moetide.engine.llm import demo_model_path
    from moetide.models.checkpoint import load_tokenizer

    tok = load_tokenizer(demo_model_path())
    texts = ("你好，世界！今天天气很好。", "Привет, как дела?", "Crème brûlée à la façon de Noël", "😀 ok")
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        partials = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(1, len(ids) + 1)]
        assert any("\ufffd" in p for p in partials)  # the case this guards: half characters mid-stream
        stream = TextStream()
        pieces = [stream.delta(p, finished=k == len(partials) - 1) for k, p in enumerate(partials)]
        assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
    assert stable_prefix("abcd", 2) == "ab" and stable_prefix("ab\ufffd\ufffd", 0) == "ab"
    # a stop string's first characters are held back until it cannot be one any more
    stream = TextStream(stop=("END",))
    assert stream.delta("hello E", False) == "hello" and stream.delta("hello EN", False) == " "
    assert stream.delta("hello ENx", False) == "E" and stream.delta("hello ENx", True) == "Nx"


def test_generate_streams_whole_characters(capsys):
    """`moetide generate` on the demo model with a Chinese prompt: the model answers in Chinese (one
    character = 2-3 byte tokens), and no U+FFFD is printed, not even for a character the token budget
    cut at the very end. stderr is not a terminal here: one plain loading line, no progress bars."""
    from moetide.cli import main

    prompt = "你好，请介绍一下你自己。"
    assert main(["generate", "--device", "cpu", "--max-tokens", "12", prompt]) == 0
    captured = capsys.readouterr()
    out = captured.out.rstrip("\n")
    assert sum("\u4e00" <= c <= "\u9fff" for c in out) >= 3, out
    assert "\ufffd" not in out, out
    assert "\r" not in captured.err and captured.err.count("[moetide] loading demo_model on cpu") == 1
    assert len(captured.err.strip().splitlines()) == 2, captured.err  # + the summary line


def test_files_named_in_pyproject_exist():
    root = Path(__file__).resolve().parent.parent
    text = (root / "pyproject.toml").read_text()
    named = set(re.findall(r"[\w.-]+\.(?:txt|md|cfg|ini)\b", text))
    assert "constraints.txt" in named
    assert all((root / name).is_file() for name in named), named


def test_a_command_whose_dependency_is_missing_says_what_to_install_and_the_others_still_run(
    monkeypatch, capsys
):
    """An install without uvicorn: `moetide serve` fails with one line, `moetide bench` still parses."""
    import builtins
    import sys

    from moetide import cli

    real_import = builtins.__import__

    def no_uvicorn(name, *args, **kwargs):
        if name == "uvicorn" or name.startswith("uvicorn."):
            raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")
        return real_import(name, *args, **kwargs)

    for module in ("moetide.serve.cli", "moetide.serve.http"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    monkeypatch.setattr(cli, "_MISSING", {})
    assert cli.main(["serve", "--model", "nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: moetide serve needs the uvicorn package: pip install uvicorn"]
    assert cli.build_parser().parse_args(["bench", "--policy", "lru"]).func.__name__ == "cmd_bench"


def test_kv_cache_tokens_reaches_the_engine_config():
    """`--kv-cache-tokens` sizes the paged KV reservation (EngineConfig.kv_cache_tokens); unset, the
    memory plan derives it."""
    from moetide.cli import build_parser, engine_config_from_args

    parser = build_parser()
    given = engine_config_from_args(
        parser.parse_args(["serve", "--device", "cpu", "--kv-cache-tokens", "8192"])
    )
    derived = engine_config_from_args(parser.parse_args(["serve", "--device", "cpu"]))
    assert (given.kv_cache_tokens, derived.kv_cache_tokens) == (8192, None)


def test_the_server_sizes_its_kv_for_max_num_seqs_and_generate_does_not():
    from moetide.cli import build_parser, engine_config_from_args
    from moetide.config import SERVE_KV_TOKENS_PER_SEQ
    from moetide.serve.cli import serve_engine_config

    args = build_parser().parse_args(["serve", "--device", "cpu", "--max-num-seqs", "64"])
    assert serve_engine_config(args).kv_tokens_per_seq == SERVE_KV_TOKENS_PER_SEQ > 0
    assert engine_config_from_args(args).kv_tokens_per_seq == 0


def _generate_with_store(checkpoint, store, policy="finemoe"):
    proc = run_cli(
        "generate", "--model", str(checkpoint), "--device", "cpu", "--max-tokens", "6", "--quiet",
        "--raw", "--policy", policy, "--gpu-memory", "50%", "--deterministic", "--map-store", str(store),
        "hello there",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return ExpertMapStore.load(store)


def test_generate_map_store_loads_then_saves(qwen3_checkpoint, tmp_path):
    """--map-store: a missing file means an empty store, written when generate ends; the next run
    starts from it (its maps plus the new run's, in order) and writes the whole store back."""
    path = tmp_path / "maps" / "store.safetensors"
    first = _generate_with_store(qwen3_checkpoint, path)
    assert len(first) > 0
    second = _generate_with_store(qwen3_checkpoint, path)
    assert len(second) == 2 * len(first)
    for row in range(len(first)):
        assert torch.equal(second.map(row), first.map(row))


def test_llm_close_saves_combined_map_store(qwen3_checkpoint, tmp_path):
    """`LLM.close` writes combined's FineMoE store, with the later maps its step-late search uses."""
    from moetide import LLM
    from moetide.engine.sampling import SamplingParams

    path = tmp_path / "store.safetensors"
    llm = LLM(
        qwen3_checkpoint,
        device="cpu",
        policy="combined",
        gpu_memory="50%",
        deterministic=True,
        map_store=str(path),
    )
    llm.generate("hello there", SamplingParams(max_tokens=6))
    assert not path.exists()  # written when the engine closes
    llm.close()
    store = ExpertMapStore.load(path)
    assert len(store) > 0 and store.state()["has_ahead"].any()
