"""Shared fixtures: tiny random checkpoints of every family, written once per test session."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import FAMILIES, save_tiny_model

# One intra-op thread: the tests' tensors are tiny, and on a 2-core machine a second thread spends
# more in synchronisation than it computes (test_parity + test_compute: 7.0 s with 1, 18.2 s with 2;
# recording 6 demo-model requests: 5.9 s with 1, 34.9 s with 2, on a busy machine).
torch.set_num_threads(1)

# Quantized expert caches of checkpoints the tests do not own (the embedded demo model) go under the
# system's temporary directory, kept between sessions (the cache key follows the shards and the
# quantizer, so a stale file is never read); subprocesses inherit it.
TEST_CACHE = Path(tempfile.gettempdir()) / f"moetide-tests-{os.getuid()}"
os.environ.setdefault("MOETIDE_CACHE", str(TEST_CACHE))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
    # the files whose kernel tests wait for the background interpreter run go last: the workers run
    # everything else meanwhile instead of one of them idling at the wait (it takes minutes)
    from triton_interpreter import KERNEL_TESTS

    items.sort(key=lambda item: Path(str(item.fspath)).name in KERNEL_TESTS)  # stable: order kept otherwise


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


XDIST_WORKERS = 2  # what CI has: 2 cores (the background interpreter run shares them)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without CUDA, `python -m pytest` runs the suite on 2 xdist workers, a file at a time each
    (`--dist loadfile`: a file's module-scoped fixtures are built once), unless the command line
    says how to distribute (`-n`, `--dist`), `--pdb` asks for one process, or xdist is not there
    (`-p no:xdist`). With CUDA it runs in one process, which owns the device: an engine without a
    cap sizes itself to the free device memory, which a second process would be using."""
    option = config.option
    if not (config.pluginmanager.hasplugin("xdist") and hasattr(option, "numprocesses")):
        return
    if hasattr(config, "workerinput") or option.numprocesses is not None or option.dist != "no":
        return
    if option.usepdb or torch.cuda.is_available():
        return
    option.numprocesses, option.dist = XDIST_WORKERS, "loadfile"


WORKER_NICENESS = 5  # xdist workers yield the CPU to the background interpreter run (see below)


def pytest_configure(config):
    """An xdist worker on a CPU-only machine runs at a lower priority than the interpreter-mode
    kernel run: that run is one process whose minutes end the session, while the two workers'
    tests can fill whatever CPU it leaves (2026-12-03 on this 2-core machine: the suite took 372 s
    with all three at the same priority, the interpreter run's own 175 s stretched to ~370 s)."""
    if hasattr(config, "workerinput") and not torch.cuda.is_available() and hasattr(os, "nice"):
        os.nice(WORKER_NICENESS)


INTERPRETER_TEST = "test_fused_kernel_under_interpreter"
_INTERPRETER_DIR = "moetide_interpreter_dir"  # workerinput key: where the controller's run writes


def _interpreter_dir(config) -> Path:
    """The folder the interpreter run writes into: the controller's under xdist (its workers are
    told it), else this process's own; made on first use."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return Path(workerinput[_INTERPRETER_DIR])
    if not hasattr(config, _INTERPRETER_DIR):
        setattr(config, _INTERPRETER_DIR, Path(tempfile.mkdtemp(prefix="moetide-interpreter-")))
    return getattr(config, _INTERPRETER_DIR)


def _start_interpreter_run(config) -> None:
    from triton_interpreter import CUDA, HAS_TRITON, INTERPRETING, start_under_interpreter

    if HAS_TRITON and not (CUDA or INTERPRETING):
        start_under_interpreter(_interpreter_dir(config))


def pytest_collection_finish(session):
    """Start the interpreter-mode kernel run in the background as soon as it is known to be needed.
    Under xdist the controller starts it (`pytest_xdist_node_collection_finished`), once for the
    session, and whichever worker runs the test waits for it.

    Also moves everything imported so far (torch, transformers, the test modules) out of the
    garbage collector's sight: a full collection (the bench's `free_device`, Python's own) then
    walks only what the tests made (0.39 s -> a few ms each, 48 of them in the suite)."""
    gc.collect()
    gc.freeze()
    if hasattr(session.config, "workerinput"):
        return
    if any(item.name == INTERPRETER_TEST for item in session.items):
        _start_interpreter_run(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: tell each worker where the interpreter run writes."""
    node.workerinput[_INTERPRETER_DIR] = str(_interpreter_dir(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: every worker collects the same tests; the first collection that holds the
    interpreter test starts the run (before any test is scheduled, so before any worker waits)."""
    if any(i.rsplit("::", 1)[-1] == INTERPRETER_TEST for i in ids):
        _start_interpreter_run(node.config)


def pytest_sessionfinish(session, exitstatus):
    """A background interpreter run nobody waited for (the session stopped early) does not outlive it."""
    import triton_interpreter

    started = triton_interpreter._STARTED
    if started is not None and started.poll() is None:
        started.kill()
        started.wait()


def pytest_unconfigure(config):
    gc.unfreeze()  # back in the collector's sight before exit (triton's bindings check for leaks then)
    folder = getattr(config, _INTERPRETER_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def interpreter_run(request):
    """The Triton kernel tests (triton_interpreter.KERNEL_TESTS), run once on CPU under
    Triton's interpreter in one fresh process (triton_interpreter.py says why a fresh one)."""
    from triton_interpreter import run_under_interpreter

    return run_under_interpreter(_interpreter_dir(request.config))
