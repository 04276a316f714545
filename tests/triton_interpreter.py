"""Running Triton kernel tests on CPU: under Triton's interpreter, in a fresh process.

triton reads TRITON_INTERPRET when it (and each kernel) is first imported; in a full test run
transformers imports triton long before the kernel tests, so on CPU they run in an interpreter-mode
subprocess and, on CUDA, compiled in the test process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()


def kernel_device() -> str:
    return "cuda" if CUDA else "cpu"


# The kernel tests of each file, selected by name (a module name would select a whole file).
KERNEL_TESTS = {
    "test_fused_moe.py": "fused_kernel and not under_interpreter",
}


@dataclass(frozen=True)
class InterpreterRun:
    """One interpreter-mode pytest process over every file's kernel tests."""

    result: subprocess.CompletedProcess
    summary: str  # the tail of its output, for assertion messages

    def passed(self, test_file: str) -> int:
        return sum(1 for line in self._outcomes("PASSED") if f"{test_file}::" in line)

    def skipped(self, test_file: str) -> int:
        return sum(1 for line in self._outcomes("SKIPPED") if test_file in line)

    def _outcomes(self, word: str) -> list[str]:
        return [line for line in self.result.stdout.splitlines() if line.startswith(word + " ")]


def _command() -> tuple[list[str], dict]:
    tests = Path(__file__).resolve().parent
    src = str(tests.parent / "src")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    keyword = " or ".join(f"({k})" for k in KERNEL_TESTS.values())
    files = [str(tests / name) for name in KERNEL_TESTS]
    return [sys.executable, "-m", "pytest", *files, "-q", "-rA", "-p", "no:cacheprovider", "-k", keyword], env


_STARTED: subprocess.Popen | None = None


def start_under_interpreter() -> None:
    """Start the interpreter run in the background (the test session calls this once it knows the
    interpreter test is collected): it takes minutes on one core while the rest of the suite uses
    the other, instead of adding its minutes to the suite's."""
    global _STARTED
    if _STARTED is None:
        command, env = _command()
        _STARTED = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_under_interpreter() -> InterpreterRun:
    """The kernel tests of `KERNEL_TESTS` with TRITON_INTERPRET=1 in one new process (one interpreter,
    torch and transformers start-up for all files; `-rA` lists each test's outcome): the background
    run if one was started, else one now."""
    start_under_interpreter()
    try:
        stdout, stderr = _STARTED.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        _STARTED.kill()
        stdout, stderr = _STARTED.communicate()
    result = subprocess.CompletedProcess(_STARTED.args, _STARTED.returncode, stdout, stderr)
    return InterpreterRun(result, result.stdout[-3000:] + result.stderr[-2000:])


def run_both_kernels(kernel, monkeypatch, path, ids: torch.Tensor, max_tokens: int, **llm_kwargs):
    """Load `path` once per kernel choice ("dequant": the per-expert reference, then "triton": the
    fused kernel) with `llm_kwargs`, and for each run the forward of `ids` and a greedy generation of
    `max_tokens` from [5, 6, 7, 8].

    Returns `({lo_kernel: (logits float32, greedy token ids, lo_runs)}, calls)`, where `calls` lists one
    entry per call of `kernel.fused_moe` (so a test can check the fused kernel really ran)."""
    import moetide

    calls = []
    real = kernel.fused_moe
    monkeypatch.setattr(kernel, "fused_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = {}
    for lo_kernel in ("dequant", "triton"):
        llm = moetide.LLM(path, lo_kernel=lo_kernel, **llm_kwargs)
        with torch.no_grad():
            logits = llm.loaded.model(ids).logits.float()
        params = moetide.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        tokens = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
        results[lo_kernel] = (logits, tokens, llm.metrics.snapshot()["lo_runs"])
        llm.close()
    return results, calls
