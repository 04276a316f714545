"""`moetide serve` as a real process: SIGTERM drains, then aborts; a second SIGTERM exits at once;
--quiet; the API key from the environment; the warning for an open non-loopback server.

The checkpoint is the tiny qwen3 one with its context raised to 32 k tokens, so that a stream of
30 000 tokens is certainly still running when a short drain timeout ends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

MODEL = "tiny-qwen3"
LONG_TOKENS = 30_000


@pytest.fixture(scope="module")
def long_context_checkpoint(qwen3_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("long-context") / "ckpt"
    shutil.copytree(qwen3_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 32_768
    (path / "config.json").write_text(json.dumps(config))
    return path


class ServeProcess:
    """`moetide serve` on a free port; `lines` collects its output (stdout and stderr) as it comes."""

    def __init__(self, checkpoint, *extra: str, env: dict | None = None):
        command = [
            sys.executable,
            "-m",
            "moetide.cli",
            "serve",
            "--model",
            str(checkpoint),
            "--device",
            "cpu",
        ]
        command += ["--port", "0", "--served-model-name", MODEL, *extra]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 120
        while not (match := re.search(r"serving .* on http://[0-9.]+:(\d+)/v1", self.output)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{match.group(1)}"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _open_stream(http: httpx.Client, url: str, max_tokens: int, headers: dict):
    body = {
        "model": MODEL,
        "prompt": "bye",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = http.send(
        http.build_request("POST", f"{url}/v1/completions", json=body, headers=headers), stream=True
    )
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))  # running
    return response, lines


def _events(lines) -> list:
    """The rest of an SSE stream: each data payload (parsed), "[DONE]" kept as is."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_sigterm_finishes_what_it_can_and_aborts_the_rest_with_done(long_context_checkpoint):
    key = "sk-from-env"
    server = ServeProcess(
        long_context_checkpoint, "--drain-timeout", "3", "--quiet", env={"MOETIDE_API_KEY": key}
    )
    try:
        assert "warning" not in server.output  # a key is set (and the host is loopback)
        assert httpx.get(f"{server.url}/health").status_code == 200  # open without the key
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(timeout=60) as http:
            short, short_lines = _open_stream(http, server.url, 60, auth)
            long, long_lines = _open_stream(http, server.url, LONG_TOKENS, auth)
            server.proc.send_signal(signal.SIGTERM)
            short_events, long_events = _events(short_lines), _events(long_lines)
            short.close()
            long.close()
        # the short stream was in flight at SIGTERM and finishes normally
        assert short_events[-1] == "[DONE]" and short_events[-2]["usage"]["completion_tokens"] == 60
        assert [c["choices"][0]["finish_reason"] for c in short_events[:-1] if c["choices"]][-1] == "length"
        # the long one is still running at the drain timeout: it ends with "abort", usage and [DONE]
        reasons = [c["choices"][0]["finish_reason"] for c in long_events[:-1] if c["choices"]]
        assert reasons[-1] == "abort" and long_events[-1] == "[DONE]"
        assert 0 < long_events[-2]["usage"]["completion_tokens"] < LONG_TOKENS
        assert server.wait(30) == -signal.SIGTERM
        assert "Traceback" not in server.output, server.output
        # --quiet: the serving line, no progress bar, no access log, no info logs
        assert next(line for line in server.lines if line.strip()).startswith("[moetide] serving"), (
            server.output
        )
        assert "loading" not in server.output and "INFO" not in server.output, server.output
        assert "POST /v1/completions" not in server.output, server.output
    finally:
        server.kill()


def test_second_sigterm_exits_at_once(long_context_checkpoint):
    server = ServeProcess(long_context_checkpoint, "--drain-timeout", "3600", "--host", "0.0.0.0")
    try:
        warnings = [line for line in server.lines if "warning: no API key" in line]
        assert len(warnings) == 1 and "0.0.0.0" in warnings[0], server.output
        with httpx.Client(timeout=60) as http:
            response, lines = _open_stream(http, server.url, LONG_TOKENS, {})
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert server.proc.poll() is None  # draining: up to an hour
            server.proc.send_signal(signal.SIGTERM)
            server.wait(120)  # exits without the drain (120 s only bounds the test)
            try:
                rest = _events(lines)
            except httpx.HTTPError:  # the connection was cut mid-chunk
                rest = []
            if "[DONE]" in rest:  # the abort reached the stream before the exit: never "length"
                reasons = [c["choices"][0]["finish_reason"] for c in rest[:-1] if c["choices"]]
                assert reasons[-1] == "abort"
            response.close()
    finally:
        server.kill()
