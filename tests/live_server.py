"""A real uvicorn server on a free loopback port over an `AsyncEngine`, for the server tests
(test_server.py, test_fairness.py): the app, the protocol and the engine thread `moetide serve` runs."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import uvicorn

from moetide.config import EngineConfig
from moetide.engine.llm import build_engine
from moetide.serve import AsyncEngine, create_app
from moetide.serve.http import read_timeout_protocol

MODEL = "tiny-qwen3"  # the name every test front end serves


@dataclass
class LiveServer:
    base_url: str
    engine: AsyncEngine
    tokenizer: object
    uvicorn_server: uvicorn.Server
    thread: threading.Thread
    api_key: str = "unused"  # what the clients send

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=60
        )

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def close(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(30)


def start_server(
    checkpoint,
    *,
    max_num_seqs: int,
    max_queue: int,
    runner_hook=None,
    model_name: str = MODEL,
    step_log: str | None = None,
) -> LiveServer:
    """An engine on `checkpoint` (CPU) and a front end that starts and stops its thread."""
    loaded, engine, tokenizer = build_engine(
        EngineConfig(model=str(checkpoint), device="cpu", max_num_seqs=max_num_seqs), progress=False
    )
    if runner_hook is not None:
        runner_hook(engine)
    async_engine = AsyncEngine(
        engine, loaded=loaded, max_queue=max_queue, expert_metrics_interval_s=0.05, step_log=step_log
    )
    return start_frontend(async_engine, tokenizer, lifespan="on", model_name=model_name)


def start_frontend(
    async_engine,
    tokenizer,
    *,
    lifespan: str = "off",
    read_timeout_s: float = 30,
    model_name: str = MODEL,
    **app_kwargs,
) -> LiveServer:
    """uvicorn on a free loopback port over `async_engine`. With lifespan "off" it is one more front end
    over an engine that another server runs (this one neither starts nor stops it)."""
    app = create_app(
        async_engine,
        tokenizer,
        model_name=model_name,
        drain_timeout_s=5,
        read_timeout_s=read_timeout_s,
        **app_kwargs,
    )
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan=lifespan,
        http=read_timeout_protocol(read_timeout_s),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", async_engine, tokenizer, server, thread)
