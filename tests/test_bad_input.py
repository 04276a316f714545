"""Bad input: one clear line naming the problem, exit status != 0, no traceback."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys

import pytest

import moetide
from moetide.errors import CheckpointError, TokenizerError, UnsupportedModelError
from moetide.models.checkpoint import inspect_checkpoint


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`moetide ARGS` in this process: exit status, stdout and stderr. The same `main` the console
    script runs, without an interpreter and torch start-up (seconds) per call; `run_cli_process` runs
    the real entry point."""
    from moetide.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's exits
            code = e.code
    return subprocess.CompletedProcess(["moetide", *args], code, out.getvalue(), err.getvalue())


def run_cli_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetide.cli", *args], capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "nope"), "hi")
    assert_one_line_error(proc, "no such file or directory")


def test_directory_without_config(tmp_path):
    proc = run_cli("info", str(tmp_path))
    assert_one_line_error(proc, "not a checkpoint", "config.json")


def test_dense_model_is_refused_with_supported_families(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path)
    proc = run_cli("info", str(tmp_path))
    assert_one_line_error(proc, "dense (non-MoE)", "qwen3_moe", "mixtral")
    with pytest.raises(UnsupportedModelError):
        moetide.LLM(tmp_path, device="cpu")


def test_unsupported_moe_family(tmp_path, qwen3_checkpoint):
    path = copy_checkpoint(qwen3_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "jamba_moe_x"
    cfg["num_experts"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("info", str(path))
    assert_one_line_error(proc, "'jamba_moe_x' is not supported", "deepseek_v2", "phimoe")


def test_truncated_shard(tmp_path, qwen3_checkpoint):
    path = copy_checkpoint(qwen3_checkpoint, tmp_path / "ckpt")
    shard = next(path.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    proc = run_cli("generate", "--model", str(path), "hi")
    # both sizes as `ls -l` gives them: what the header describes and what the file has
    assert_one_line_error(
        proc, "truncated safetensors shard", shard.name, f"describes {len(data):,} bytes", f"has {len(data) - 1000:,}"
    )
    with pytest.raises(CheckpointError, match="truncated"):
        inspect_checkpoint(path)


def test_corrupt_shard_header(tmp_path, qwen3_checkpoint):
    path = copy_checkpoint(qwen3_checkpoint, tmp_path / "ckpt")
    shard = next(path.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:20] = b"garbage!!!!!"
    shard.write_bytes(bytes(data))
    proc = run_cli("info", str(path))
    assert_one_line_error(proc, "corrupt safetensors shard", shard.name)


def test_shard_that_is_not_safetensors(tmp_path, qwen3_checkpoint):
    path = copy_checkpoint(qwen3_checkpoint, tmp_path / "ckpt")
    shard = next(path.glob("*.safetensors"))
    shard.write_bytes(b"abc")
    proc = run_cli("info", str(path))
    assert_one_line_error(proc, "not a safetensors file")


def test_missing_tokenizer(tmp_path, qwen3_checkpoint):
    path = copy_checkpoint(qwen3_checkpoint, tmp_path / "ckpt")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / f).unlink(missing_ok=True)
    proc = run_cli("generate", "--model", str(path), "hi")
    assert_one_line_error(proc, "no tokenizer files")
    with pytest.raises(TokenizerError):
        moetide.LLM(path, device="cpu")


def test_cuda_requested_without_cuda(qwen3_checkpoint):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli("generate", "--model", str(qwen3_checkpoint), "--device", "cuda", "hi")
    assert_one_line_error(proc, "CUDA is not available")


def test_bad_memory_size(qwen3_checkpoint):
    proc = run_cli("generate", "--model", str(qwen3_checkpoint), "--gpu-memory", "lots", "hi")
    assert_one_line_error(proc, "cannot read memory size")


def test_unknown_llm_option_is_an_error_not_ignored(qwen3_checkpoint):
    from moetide.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown option.*searchr"):
        moetide.LLM(qwen3_checkpoint, device="cpu", searchr="thread")
    with pytest.raises(ConfigError, match="--searcher must be one of"):
        moetide.LLM(qwen3_checkpoint, device="cpu", searcher="fiber")


# -- the CLI checks what the user typed before the model loads ----------------------------------------------
def assert_refused_before_load(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """One `error:` line on stderr and exit status 2, and nothing else: a load would have printed
    "[moetide] loading ..." (stderr is not a terminal here) before reading the weights."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--device", "tpu"], ["--device must be cpu, cuda or cuda:N", "'tpu'"]),
        (["--policy", "bogus"], ["--policy", "invalid choice: 'bogus'"]),
        (["--gpu-memory", "-5GiB"], ["memory size must be positive", "-5GiB"]),
        (["--gpu-memory", "lots"], ["cannot read memory size 'lots'"]),
        (["--max-tokens", "0"], ["max_tokens must be an integer >= 1"]),
        (["--max-tokens", "-3"], ["max_tokens must be an integer >= 1"]),
        (["--top-p", "0"], ["top_p must be in (0, 1]"]),
        (["--top-p", "1.5"], ["top_p must be in (0, 1]"]),
        (["--temperature", "-1"], ["temperature must be a finite number >= 0"]),
        (["--max-tokens", "ten"], ["--max-tokens", "invalid int value"]),
        (["--kv-cache-tokens", "0"], ["--kv-cache-tokens must be a whole number of tokens >= 1", "0"]),
    ],
)
def test_bad_generate_options_are_one_line_before_the_load(qwen3_checkpoint, args, fragments):
    proc = run_cli("generate", "--model", str(qwen3_checkpoint), "--device", "cpu", *args, "hi")
    assert_refused_before_load(proc, *fragments)


def test_empty_prompt_is_refused(qwen3_checkpoint):
    for prompt in ("", "   "):
        proc = run_cli("generate", "--model", str(qwen3_checkpoint), "--device", "cpu", prompt)
        assert_refused_before_load(proc, "the prompt is empty")


def test_output_past_the_context_is_refused_before_the_load(qwen3_checkpoint):
    """The tiny checkpoint's context is 256 tokens (max_position_embeddings)."""
    base = ["generate", "--model", str(qwen3_checkpoint), "--device", "cpu", "--raw"]
    proc = run_cli(*base, "--max-tokens", "100000", "hello")
    assert_refused_before_load(proc, "--max-tokens 100000 does not fit", "context of 256 tokens")
    prompt_tokens = int(proc.stderr.split("prompt's ")[1].split()[0])
    assert f"use --max-tokens {256 - prompt_tokens} or less" in proc.stderr
    proc = run_cli(*base, "--max-model-len", "64", "--max-tokens", "100", "hello")
    assert_refused_before_load(proc, "context of 64 tokens")
    # a prompt longer than the demo model's context and its tokenizer's model_max_length (2048): our
    # line only, not transformers' "Token indices sequence length is longer than ..." warning first
    proc = run_cli("generate", "--device", "cpu", "--raw", "hello " * 2100)
    assert_refused_before_load(proc, "the prompt has", "the context holds 2048")


def test_too_small_a_budget_is_refused_before_the_load(qwen3_checkpoint):
    proc = run_cli("generate", "--model", str(qwen3_checkpoint), "--device", "cpu", "--gpu-memory", "1KiB", "hi")
    assert_refused_before_load(proc, "--gpu-memory 1.00 KiB is too small", "the smallest budget")
