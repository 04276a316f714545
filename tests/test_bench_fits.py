"""A benchmark larger than the machine is refused before anything is written or loaded, with the
size it needs; one that fits runs."""

from __future__ import annotations

import pytest
from test_bad_input import assert_one_line_error, run_cli

from moetide.bench.host_memory import available_host_bytes, check_fits, parameter_counts
from moetide.bench.synthetic import synthetic_config
from moetide.config import format_bytes
from moetide.engine.llm import demo_model_path
from moetide.errors import ConfigError
from moetide.models.checkpoint import load_config


def test_available_memory_is_what_the_kernel_reports():
    with open("/proc/meminfo") as f:
        total = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
    have = available_host_bytes()
    assert have is not None and 0 < have <= total


def test_a_synthetic_shape_larger_than_the_machine_is_refused_before_it_is_written(tmp_path):
    """Mixtral-8x7B's shape in float32 on the CPU: every weight in host memory, 4 bytes each."""
    config = synthetic_config("mixtral-8x7b")
    total, experts = parameter_counts(config)
    assert 40e9 < total < 50e9 and 0.9 * total < experts < total  # Mixtral-8x7B: 46.7 B, mostly experts
    need = total * 4
    if need <= available_host_bytes():
        pytest.skip(f"this machine holds {format_bytes(need)}")
    synthetic_dir = tmp_path / "synthetic"
    proc = run_cli(
        "bench", "--synthetic", "mixtral-8x7b", "--device", "cpu", "--policy", "combined",
        "--synthetic-dir", str(synthetic_dir), "--out", str(tmp_path / "out"), "--quiet",
    )  # fmt: skip
    assert_one_line_error(proc, "mixtral-8x7b", f"needs at least {format_bytes(need)}", "available")
    assert not synthetic_dir.exists()


def test_the_demo_model_fits_and_a_bf16_run_needs_half_the_bytes():
    config = load_config(demo_model_path())
    check_fits(config, "cpu", "auto", "the demo model")  # 29 M parameters
    total, experts = parameter_counts(config)
    have = available_host_bytes()
    # the same configuration, scaled past the machine: float32 needs 4 bytes a weight, bf16 2
    config.num_experts = config.num_experts * max(2, int(have / (experts * 2)) + 1)
    scaled, _ = parameter_counts(config)
    if scaled * 2 > have:
        with pytest.raises(ConfigError, match=f"needs at least {format_bytes(scaled * 2)}"):
            check_fits(config, "cpu", "bfloat16", "a wide demo model")
    with pytest.raises(ConfigError, match=f"needs at least {format_bytes(scaled * 4)}"):
        check_fits(config, "cpu", "float32", "a wide demo model")
