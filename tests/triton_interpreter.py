"""Running Triton kernel tests on CPU: under Triton's interpreter, in a fresh process.

triton reads TRITON_INTERPRET when it (and each kernel) is first imported; in a full test run
transformers imports triton long before the kernel tests, so on CPU they run in an interpreter-mode
subprocess and, on CUDA, compiled in the test process.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()


def kernel_device() -> str:
    return "cuda" if CUDA else "cpu"


def kernel_module(name: str, interpreter_test: str):
    """The kernel module `name` for a kernel test of this process: skipped without triton, and on a
    CPU outside the interpreter run (there `interpreter_test` runs the kernel tests in a subprocess)."""
    import pytest

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not (CUDA or INTERPRETING):
        pytest.skip(f"on CPU this runs in a subprocess: {interpreter_test}")
    return importlib.import_module(name)


def assert_kernel_tests_passed(run: InterpreterRun, test_file: str, minimum: int) -> None:
    """The interpreter run exited cleanly and passed at least `minimum` tests of `test_file`."""
    assert run.timed_out is None, f"the interpreter run timed out: {run.timed_out}\n{run.summary}"
    assert run.result.returncode == 0, run.summary
    assert run.passed(test_file) >= minimum, run.summary


# The kernel tests of each file, selected by name (a module name would select a whole file).
KERNEL_TESTS = {
    "test_fused_moe.py": "fused_kernel and not under_interpreter",
    "test_paged_attention.py": "paged_kernel and not under_interpreter",
    "test_routing.py": "routing_kernel and not under_interpreter",
}


@dataclass(frozen=True)
class InterpreterRun:
    """One interpreter-mode pytest process over every file's kernel tests."""

    result: subprocess.CompletedProcess
    summary: str  # the tail of its output, for assertion messages
    timed_out: str | None = None  # why it was killed before it finished (None: it ran to its end)

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
    # one process (tests/conftest.py would give a plain pytest command xdist workers)
    serial = ["-n", "0"] if importlib.util.find_spec("xdist") is not None else []
    command = [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        *serial,
        "-k",
        keyword,
    ]
    return command, env


_STARTED: subprocess.Popen | None = None


def start_under_interpreter(folder: Path) -> None:
    """Start the interpreter run in the background (the test session calls this once it knows the
    interpreter test is collected): it takes minutes on one core while the rest of the suite uses
    the other, instead of adding its minutes to the suite's.

    The run writes into `folder`: `pid` at once, `stdout` and `stderr` as it goes, and `returncode`
    once it has exited, so that another process of the session (an xdist worker) can wait for it."""
    global _STARTED
    if _STARTED is not None:
        return
    command, env = _command()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        _STARTED = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    _write_atomically(folder / "pid", str(_STARTED.pid))
    process = _STARTED

    def record_exit():
        returncode = process.wait()
        try:
            _write_atomically(folder / "returncode", str(returncode))
        except OSError:
            pass  # the session ended first and removed the folder

    threading.Thread(target=record_exit, name="interpreter-run", daemon=True).start()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run_under_interpreter(folder: Path, timeout_s: float = 3600) -> InterpreterRun:
    """The kernel tests of `KERNEL_TESTS` with TRITON_INTERPRET=1 in one new process (one interpreter,
    torch and transformers start-up for all files; `-rA` lists each test's outcome): the background
    run that wrote or writes into `folder` if one was started (by this process or another of the
    session), else one started now. A run still going after `timeout_s` (a hang: it takes minutes)
    is killed, and its `timed_out` says so; `folder/timed_out` tells the session's other processes."""
    if not (folder / "pid").exists():
        start_under_interpreter(folder)
    done, killed = folder / "returncode", folder / "timed_out"
    deadline = time.monotonic() + timeout_s
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not done.exists():  # past the timeout: end it, as a failed run
        _write_atomically(killed, f"still running after {timeout_s:g} s, killed (SIGKILL)")
        try:
            os.kill(int((folder / "pid").read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    returncode = int(done.read_text()) if done.exists() else None
    stdout, stderr = (folder / "stdout").read_text(), (folder / "stderr").read_text()
    result = subprocess.CompletedProcess(_command()[0], returncode, stdout, stderr)
    why = killed.read_text() if killed.exists() else None
    return InterpreterRun(result, result.stdout[-3000:] + result.stderr[-2000:], why)


def run_both_kernels(kernel, monkeypatch, path, ids: torch.Tensor, max_tokens: int, prompt=(5, 6, 7, 8),
                     **llm_kwargs):  # fmt: skip
    """Load `path` once per kernel choice ("dequant": the per-expert reference, then "fused": the fused
    kernel, `--lo-kernel cuda` on CUDA and `triton` under the interpreter) with `llm_kwargs`, and for
    each run the forward of `ids` and a greedy generation of `max_tokens` from `prompt`.

    Returns `({"dequant" | "fused": (logits float32, greedy token ids, lo_runs)}, calls)`, where `calls`
    lists one entry per call of `kernel.fused_moe` (so a test can check the fused kernel really ran)."""
    import moetide

    calls = []
    real = kernel.fused_moe
    monkeypatch.setattr(kernel, "fused_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = {}
    fused = "cuda" if torch.cuda.is_available() else "triton"
    for name, lo_kernel in (("dequant", "dequant"), ("fused", fused)):
        llm = moetide.LLM(path, lo_kernel=lo_kernel, **llm_kwargs)
        with torch.no_grad():
            logits = llm.loaded.model(ids).logits.float()
        params = moetide.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        tokens = llm.generate([list(prompt)], params)[0].token_ids
        results[name] = (logits, tokens, llm.metrics.snapshot()["lo_runs"])
        llm.close()
    return results, calls
