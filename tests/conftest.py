"""Shared fixtures: tiny random checkpoints of every family, written once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import FAMILIES, save_tiny_model

# One intra-op thread: the tests' tensors are tiny, and on a 2-core machine a second thread spends
# more in synchronisation than it computes (test_parity + test_compute: 7.0 s with 1, 18.2 s with 2;
# recording 6 demo-model requests: 5.9 s with 1, 34.9 s with 2, on a busy machine).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """{model_type: (checkpoint dir, the transformers model that wrote it)}."""
    out = {}
    for fam in FAMILIES:
        path = tmp_path_factory.mktemp(fam)
        out[fam] = (path, save_tiny_model(fam, path))
    return out


@pytest.fixture(scope="session")
def qwen3_checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints["qwen3_moe"][0]


def pytest_collection_finish(session):
    """Start the interpreter-mode kernel run in the background as soon as it is known to be needed."""
    if any(item.name == "test_fused_kernel_under_interpreter" for item in session.items):
        from triton_interpreter import CUDA, HAS_TRITON, INTERPRETING, start_under_interpreter

        if HAS_TRITON and not (CUDA or INTERPRETING):
            start_under_interpreter()


def pytest_sessionfinish(session, exitstatus):
    """A background interpreter run nobody waited for (the session stopped early) does not outlive it."""
    import triton_interpreter

    started = triton_interpreter._STARTED
    if started is not None and started.poll() is None:
        started.kill()
        started.communicate()


@pytest.fixture(scope="session")
def interpreter_run():
    """The Triton kernel tests (triton_interpreter.KERNEL_TESTS), run once on CPU under
    Triton's interpreter in one fresh process (triton_interpreter.py says why a fresh one)."""
    from triton_interpreter import run_under_interpreter

    return run_under_interpreter()
