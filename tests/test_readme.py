"""Every command line of README.md's code blocks, run as a new user would, on the CPU and the demo
model, in a fresh folder (a link named `src` to the repository's sources, so the README's paths
resolve; what the commands write stays under the test's temporary directory).

How each line is taken:
- `moetide ...` (alone or as the last step of an `&&` chain, the install line's included): exit 0,
  no traceback, no warning; the install line's in its own process, as the console script runs it,
  the others through the same `main` in this process (in the fresh folder), which saves each an
  interpreter and torch start-up;
- `python -m pytest ...` on named files: run in the fresh folder (links to `tests/` and
  `pyproject.toml` beside `src`), exit 0;
- `curl ...`, and each Python block: run as written, exit 0;
- `moetide serve ... &` starts the server in the background; `kill %1` stops it (SIGTERM): it must
  drain and exit on that signal, with no traceback and no progress redraw in its log;
- a line that ends in `# needs a GPU` (or `# needs a CUDA GPU`) is not run here;
- the setup steps (`python3 -m venv`, `pip install`, `. .venv/bin/activate`) and the whole suite
  (`python -m pytest -q`) are not run: they are what runs this test.
One substitution: port 8000 becomes a free port of this machine (another process may hold 8000).
Every other line must fall in one of these kinds, so a new README line is run or named.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_bad_input import run_cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GPU_MARK = re.compile(r"#\s*needs a (CUDA )?GPU\s*$")
SETUP = re.compile(r"^(python3 -m venv|\. \.venv/bin/activate && python -m pytest -q$)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of README.md, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text())]


def classify(line: str) -> str:
    """One README shell line's kind: gpu, setup, serve, kill, moetide, shell, or unknown."""
    if GPU_MARK.search(line):
        return "gpu"
    if SETUP.match(line):
        return "setup"
    command = line.split("#", 1)[0].strip()
    if command.startswith("moetide serve") and command.endswith("&"):
        return "serve"
    if command == "kill %1":
        return "kill"
    if command.startswith("moetide "):
        return "moetide"
    if command.startswith("curl "):
        return "shell"
    if command.startswith("python -m pytest "):
        return "pytest"
    return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_readme_shell_line_is_of_a_known_kind():
    lines = [l for lang, text in readme_blocks() if lang == "bash" for l in text.splitlines() if l.strip()]
    kinds = {line: classify(line) for line in lines}
    assert [l for l, k in kinds.items() if k == "unknown"] == []
    assert {"gpu", "setup", "serve", "kill", "moetide", "shell", "pytest"} <= set(kinds.values()), kinds


def _moetide(argv: list[str], cwd: Path, env: dict, what: str, *, own_process: bool) -> None:
    if own_process:
        proc = subprocess.run(
            [sys.executable, "-m", "moetide.cli", *argv], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=600, check=False,
        )  # fmt: skip
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            proc = run_cli(*argv)
        assert not [str(w.message) for w in caught if w.category is UserWarning], (what, caught)
    assert proc.returncode == 0, f"{what}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, f"{what}\n{proc.stderr[-3000:]}"


@pytest.fixture
def readme_env(tmp_path):
    for name in ("src", "tests", "pyproject.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return tmp_path, env


@pytest.mark.slow
def test_every_cpu_line_of_the_readme_runs(readme_env, monkeypatch):  # long: one walk through the README
    cwd, env = readme_env
    monkeypatch.chdir(cwd)
    port = str(free_port())
    server = None
    ran = []
    try:
        for lang, text in readme_blocks():
            text = text.replace("8000", port)
            if lang == "python":
                proc = subprocess.run(
                    [sys.executable, "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                    timeout=600, check=False,
                )  # fmt: skip
                assert proc.returncode == 0 and proc.stdout.strip(), f"{text}\n{proc.stderr[-3000:]}"
                ran.append("python block")
                continue
            if lang != "bash":
                continue
            for line in filter(str.strip, text.splitlines()):
                kind = classify(line)
                command = line.split("  #", 1)[0].strip()
                last = command.split("&&")[-1].strip()
                if kind in ("moetide", "setup") and last.startswith("moetide "):
                    _moetide(shlex.split(last)[1:], cwd, env, line, own_process=kind == "setup")
                elif kind == "serve":
                    argv = shlex.split(command.rstrip("&"))[1:]
                    server = subprocess.Popen(
                        [sys.executable, "-m", "moetide.cli", *argv], cwd=cwd, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    )  # fmt: skip
                elif kind == "pytest":
                    argv = shlex.split(command)[1:]
                    proc = subprocess.run(
                        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=600,
                        check=False,
                    )  # fmt: skip
                    assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}"
                elif kind == "shell":
                    proc = subprocess.run(
                        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300,
                        check=False,
                    )  # fmt: skip
                    assert proc.returncode == 0, f"{line}\n{proc.stderr[-2000:]}"
                elif kind == "kill":
                    assert server is not None, "kill %1 without a server started before it"
                    server.send_signal(signal.SIGTERM)
                    _, err = server.communicate(timeout=120)
                    # drained, uvicorn re-raises the signal: the status a shell reports for `kill`
                    assert server.returncode in (0, -signal.SIGTERM), err[-3000:]
                    assert "\r" not in err and "Traceback" not in err, err[-3000:]
                    server = None
                else:
                    continue
                ran.append(line)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    assert any(l.startswith("moetide generate") for l in ran) and "python block" in ran, ran


def _pinned(text: str, name: str) -> bool:
    """`name` is cited at a commit ("script in git at 9701646") and that commit holds it."""
    for at in (m.start() for m in re.finditer(re.escape(name), text)):
        for commit in re.findall(r"\b[0-9a-f]{7,40}\b", text[max(0, at - 120) : at + len(name) + 80]):
            probe = ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{name}"]
            if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
                return True
    return False


def test_every_repository_path_the_docs_name_exists():
    """A file or folder the README, ARCHITECTURE.md, BENCHMARKS.md or docs/ name (`scripts/...`,
    `tests/...`, `src/...`, `docs/...`, `results/...`; a `*` matches as a glob) is in the repository,
    or is cited at a commit that holds it (a measurement's script since removed)."""
    docs = [README, ROOT / "ARCHITECTURE.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    path = re.compile(r"(?<![\w/.~-])((?:scripts|tests|src|docs|results)/[\w./*+-]*[\w*])")
    missing = [
        f"{doc.name}: {name}"
        for doc in docs
        for text in [doc.read_text()]
        for name in dict.fromkeys(path.findall(text))
        if not (any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()) and not _pinned(text, name)
    ]
    assert missing == [], missing
