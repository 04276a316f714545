"""Bad input: one clear line naming the problem, exit status != 0, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import moetide
from moetide.errors import CheckpointError, TokenizerError, UnsupportedModelError
from moetide.models.checkpoint import inspect_checkpoint


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetide.cli", *args], capture_output=True, text=True, timeout=120
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
    assert_one_line_error(proc, "truncated safetensors shard", shard.name)
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
