"""The CLI end to end on a tiny checkpoint: streamed text, one summary line, info."""

from __future__ import annotations

import re

from test_bad_input import run_cli


def test_generate_streams_and_summarises(qwen3_checkpoint):
    proc = run_cli(
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
