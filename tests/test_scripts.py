"""scripts/: every maintained tool is documented in scripts/README.md and runs on the CPU (its options
parse and its imports resolve against the package as it is); the CPU-only ones do a small real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PYTHON_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py"))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def run(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env or ENV, check=False
    )


def test_every_script_is_documented_in_the_readme():
    readme = (SCRIPTS / "README.md").read_text()
    files = sorted(p.name for p in SCRIPTS.iterdir() if p.name != "README.md")
    assert files == sorted([*PYTHON_SCRIPTS, "gpu.sh"]), files
    assert [name for name in files if f"`{name}" not in readme] == []


@pytest.mark.parametrize("name", PYTHON_SCRIPTS)
def test_every_python_script_prints_its_options(name):
    done = run(sys.executable, str(SCRIPTS / name), "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]


def test_the_gpu_driver_parses_and_names_its_steps_for_an_unknown_one(tmp_path):
    assert run("bash", "-n", str(SCRIPTS / "gpu.sh")).returncode == 0
    done = run("bash", str(SCRIPTS / "gpu.sh"), "nosuch", env={**ENV, "OUT": str(tmp_path)})
    steps = "build tests decode offload server searcher trace tune eval train"
    assert f"unknown step nosuch (steps: {steps})" in done.stdout
    log = (tmp_path / "run.log").read_text()
    assert "=== nosuch" in log
    cases = (SCRIPTS / "gpu.sh").read_text().split('case "$step" in', 1)[1]
    assert [s for s in steps.split() if f"    {s})" not in cases] == []  # each named step has its case


def test_the_searcher_cpu_benchmark_runs_a_few_steps():
    done = run(
        sys.executable,
        str(SCRIPTS / "bench_searcher_cpu.py"),
        "--maps",
        "20",
        "--steps",
        "5",
        "--layers",
        "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "us" in done.stdout or "µs" in done.stdout, done.stdout


def test_step_log_summarises_a_real_servers_log(qwen3_checkpoint, tmp_path):
    """A server started with a step log serves two requests; step_log.py reads that log back."""
    from live_server import MODEL, start_server

    log_path = tmp_path / "steps.jsonl"
    live = start_server(qwen3_checkpoint, max_num_seqs=2, max_queue=4, step_log=str(log_path))
    try:
        for prompt in ("one two three", "four five"):
            out = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
            assert out.usage.completion_tokens == 3
    finally:
        live.close()
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    done = run(sys.executable, str(SCRIPTS / "step_log.py"), str(log_path), "--slowest", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert out[0].startswith(f"{len(lines)} iterations over ")
    assert any(row.strip().startswith("decode") for row in out) and any("prefill" in row for row in out)
    assert out[-3] == "slowest 2:" and len(out[-2:]) == 2


def test_step_log_refuses_a_missing_log_in_one_line(tmp_path):
    done = run(sys.executable, str(SCRIPTS / "step_log.py"), str(tmp_path / "none.jsonl"))
    assert done.returncode == 1 and done.stderr.strip() == f"no step log at {tmp_path / 'none.jsonl'}"
