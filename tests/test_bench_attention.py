"""scripts/bench_attention.py's correctness check on CPU: every decode-attention variant that runs
here (the engine's gather + SDPA, FlexAttention eager, transformers' paged SDPA / eager, the Triton
paged-decode kernel under Triton's interpreter, with and without split-K) gives the float32
reference on tiny shapes (MHA and GQA, shuffled blocks, equal and mixed row lengths, a row holding
only its new token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_attention.py"
CPU_VARIANTS = {
    "gather_sdpa", "flex_paged", "hf_paged_sdpa", "hf_paged_eager", "triton_paged", "triton_paged_nosplit"
}
CUDA_ONLY = {"hf_paged_flash", "torch_varlen_paged"}

# in a fresh process: triton reads TRITON_INTERPRET when it is first imported
_RUN = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("bench_attention", {str(SCRIPT)!r})
bench = sys.modules["bench_attention"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
print("ROWS=" + json.dumps(bench.correctness("cpu", quick=True)))
"""


@pytest.fixture(scope="module")
def rows():
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-c", _RUN]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("ROWS="))
    return json.loads(line[len("ROWS=") :])


@pytest.mark.slow
def test_every_cpu_variant_matches_the_float32_reference(rows):
    assert {r["variant"] for r in rows} == CPU_VARIANTS | CUDA_ONLY
    checked = [r for r in rows if r["variant"] in CPU_VARIANTS]
    assert {(r["shape"], r["context"]) for r in checked} >= {("tiny-gqa", "mixed:1-40"), ("tiny-mha", 37)}
    bad = [r for r in checked if r["error"] is not None or not r["max_abs_err"] < 1e-4]
    assert bad == []


@pytest.mark.slow
def test_cuda_only_variants_say_why_they_did_not_run(rows):
    for r in rows:
        if r["variant"] in CUDA_ONLY:
            assert r["error"].startswith("unavailable: "), r
