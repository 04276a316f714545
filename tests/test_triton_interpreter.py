"""The interpreter-mode subprocess of the kernel tests (tests/triton_interpreter.py): a run that is
still going past its timeout is killed and reported as timed out, not as a bare exit status."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from triton_interpreter import InterpreterRun, assert_kernel_tests_passed, run_under_interpreter


def _background_run(folder, code: str) -> subprocess.Popen:
    """A process in `folder` as `start_under_interpreter` leaves one: pid, output files, and the
    return code written once it exits."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err)
    (folder / "pid").write_text(str(process.pid))
    threading.Thread(
        target=lambda: (folder / "returncode").write_text(str(process.wait())), daemon=True
    ).start()
    return process


def test_a_run_past_its_timeout_is_killed_and_reported_as_timed_out(tmp_path):
    process = _background_run(tmp_path, "import time; print('started', flush=True); time.sleep(600)")
    run = run_under_interpreter(tmp_path, timeout_s=1)
    assert process.poll() is not None  # killed, not left running
    assert run.timed_out == "still running after 1 s, killed (SIGKILL)"
    with pytest.raises(AssertionError, match="the interpreter run timed out: still running after 1 s"):
        assert_kernel_tests_passed(run, "test_fused_moe.py", 1)


def test_a_run_that_ends_in_time_is_not_timed_out(tmp_path):
    _background_run(tmp_path, "print('PASSED tests/test_fused_moe.py::test_x')")
    run = run_under_interpreter(tmp_path, timeout_s=600)
    assert isinstance(run, InterpreterRun) and run.timed_out is None
    assert_kernel_tests_passed(run, "test_fused_moe.py", 1)
