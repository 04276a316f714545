"""The OpenAI-compatible server end to end: real uvicorn on loopback, the official `openai` client.

Two engines on the tiny qwen3 checkpoint (CPU), each built once: `server` (32 batch slots) for the
API, concurrency and bad input; `slow_server` (one batch slot, a queue of one, 20 ms per decode
step) where queueing, disconnects and a failing step are deterministic. `guarded` is a second
front end (API key, small size and time limits) over `server`'s engine. `moetide serve` in a
subprocess (SIGTERM, --quiet, the API key from the environment) is in test_server_shutdown.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from live_server import MODEL, LiveServer, start_frontend, start_server

from moetide.config import EngineConfig
from moetide.engine.llm import build_engine
from moetide.engine.sampling import SamplingParams
from moetide.serve import AsyncEngine

CONTEXT = 256  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and on a busy 2-core runner OpenMP's
    spinning workers make every step ~100x slower; one thread keeps this file's timing honest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server(qwen3_checkpoint):
    live = start_server(qwen3_checkpoint, max_num_seqs=32, max_queue=64)
    yield live
    live.close()
    assert not live.engine.is_alive


class SlowRunner:
    """Wraps the engine's decode: 20 ms per step, and an injectable failure."""

    def __init__(self, engine):
        self.engine = engine
        self.decode = engine.runner.decode
        self.fail_when_queued = False  # raise once, on the first decode while a request waits
        engine.runner.decode = self  # this instance only; the class is untouched

    def __call__(self, seqs, chunks=(), **kwargs):
        time.sleep(0.02)
        if self.fail_when_queued and self.engine.waiting:
            self.fail_when_queued = False
            raise RuntimeError("injected decode failure")
        return self.decode(seqs, chunks, **kwargs)


@pytest.fixture(scope="module")
def slow_server(qwen3_checkpoint):
    hooks = {}
    live = start_server(
        qwen3_checkpoint,
        max_num_seqs=1,
        max_queue=1,
        runner_hook=lambda engine: hooks.setdefault("runner", SlowRunner(engine)),
    )
    live.slow_runner = hooks["runner"]
    yield live
    live.close()


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def greedy(max_tokens: int, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True, **extra}}


def still_serves(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt="ok", **greedy(2))
    assert out.usage.completion_tokens == 2


def test_the_step_log_records_each_engine_iteration(qwen3_checkpoint, tmp_path):
    """--step-log: a JSON line per engine-thread iteration, with the step's shape; a path that cannot
    be written is refused at start with a one-line error."""
    from moetide.errors import ConfigError

    log_path = tmp_path / "steps.jsonl"
    live = start_server(qwen3_checkpoint, max_num_seqs=2, max_queue=4, step_log=str(log_path))
    try:
        out = live.client().completions.create(model=MODEL, prompt="one two three", **greedy(3))
        assert out.usage.completion_tokens == 3
        with pytest.raises(ConfigError, match="^--step-log .*: cannot write the step log there"):
            AsyncEngine(live.engine.engine, step_log=str(tmp_path / "missing" / "steps.jsonl"))
    finally:
        live.close()
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    stepped = [x for x in lines if "decode" in x]
    assert stepped and all(x["step_s"] >= 0 and x["deliver_s"] >= 0 for x in lines)
    assert stepped[0]["prefill"] > 0 and sum(x["decode"] for x in stepped) == 2  # 1 token from prefill
    assert sum(x["added"] for x in lines) == 1


# -- the API with the official client ----------------------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_streaming_equals_non_streaming(server):
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="The cat", **greedy(12))
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(server.tokenizer.encode("The cat"))
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The cat", stream=True, stream_options={"include_usage": True}, **greedy(12)
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    by_ids = client.completions.create(model=MODEL, prompt=server.tokenizer.encode("The cat"), **greedy(12))
    assert by_ids.choices[0].text == choice.text


def test_chat_streaming_equals_non_streaming(server):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **greedy(10))
    assert full.choices[0].message.role == "assistant"
    expected_prompt = server.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected_prompt = expected_prompt["input_ids"] if hasattr(expected_prompt, "keys") else expected_prompt
    assert full.usage.prompt_tokens == len(expected_prompt)
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **greedy(10)))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_is_never_streamed(server):
    client = server.client()
    free = client.completions.create(model=MODEL, prompt="abc", **greedy(30)).choices[0].text
    stop = free[4:7]
    cut = client.completions.create(model=MODEL, prompt="abc", stop=[stop], **greedy(30)).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[: free.find(stop)]
    streamed = client.completions.create(model=MODEL, prompt="abc", stop=[stop], stream=True, **greedy(30))
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_32_concurrent_requests_complete_and_equal_each_alone(server):
    prompts = [f"{i} {'abcdefghij'[: i % 10]} request number {i * 7}" for i in range(32)]
    lengths = [4 + (i * 5) % 29 for i in range(32)]

    async def run_all():
        client = server.async_client()

        async def one(i):
            if i % 2:  # half of them stream
                stream = await client.completions.create(
                    model=MODEL,
                    prompt=prompts[i],
                    stream=True,
                    stream_options={"include_usage": True},
                    **greedy(lengths[i]),
                )
                text, n = "", None
                async for chunk in stream:
                    text += "".join(c.text for c in chunk.choices)
                    n = chunk.usage.completion_tokens if chunk.usage else n
                return text, n
            out = await client.completions.create(model=MODEL, prompt=prompts[i], **greedy(lengths[i]))
            return out.choices[0].text, out.usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    together = asyncio.run(run_all())
    assert [n for _, n in together] == lengths
    client = server.client()
    for i, (text, _) in enumerate(together):
        alone = client.completions.create(model=MODEL, prompt=prompts[i], **greedy(lengths[i]))
        assert alone.choices[0].text == text, f"request {i} differs when batched"


def test_metrics_expose_the_listed_series(server):
    still_serves(server)
    wait_for(lambda: server.metric("moetide_expert_hits_total") > 0, what="expert metrics refresh")
    text = httpx.get(f"{server.base_url}/metrics").text
    for series in (
        "moetide_time_to_first_token_seconds_bucket",
        "moetide_time_per_output_token_seconds_bucket",
        "moetide_num_requests_waiting",
        "moetide_num_requests_running",
        'moetide_requests_finished_total{finish_reason="length"}',
        "moetide_expert_hit_rate",
        "moetide_expert_lo_runs_total",
        "moetide_expert_bytes_moved_total",
        'moetide_resident_experts{precision="hi"}',
        "moetide_expert_promotions_total",
        "moetide_expert_demotions_total",
    ):
        assert series in text, series
    assert server.metric("moetide_time_to_first_token_seconds_count") >= 1
    assert server.metric("moetide_num_requests_running") == 0
    # the CPU engine reads every expert in place: all of them are resident in hi, and each use is a hit
    layers, experts = len(server.engine.engine.runner.model.model.layers), 8
    assert server.metric('moetide_resident_experts{precision="hi"}') == layers * experts


def test_metrics_count_prefix_cache_hits_and_kv_blocks(server, qwen3_checkpoint):
    """Two requests sharing a 40-token prefix: the second finds its two full blocks (32 tokens) in
    the prefix cache, and /metrics says so; both get what they get alone without the cache."""
    still_serves(server)
    prefix = [(7 * i) % 80 + 10 for i in range(40)]
    total = server.engine.engine.blocks.num_blocks
    wait_for(lambda: server.metric("moetide_kv_blocks_total") == total, what="KV metrics refresh")
    hits, queries = "moetide_prefix_cache_hits_total", "moetide_prefix_cache_queries_total"
    before = server.metric(hits), server.metric(queries)
    client = server.client()
    texts = [
        client.completions.create(model=MODEL, prompt=prefix + tail, **greedy(5)).choices[0].text
        for tail in ([11, 12, 13], [14, 15])
    ]
    wait_for(lambda: server.metric(hits) >= before[0] + 32, what="prefix hits")
    assert server.metric(queries) >= before[1] + 2 * 40 + 5
    wait_for(lambda: server.metric("moetide_kv_blocks_used") == 0, what="blocks freed")  # nothing runs
    # the same prompts on an engine without the cache
    config = EngineConfig(model=str(qwen3_checkpoint), device="cpu", prefix_caching=False)
    _, engine, _ = build_engine(config, progress=False)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(prefix + tail, params) for tail in ([11, 12, 13], [14, 15])]
    while engine.has_unfinished():
        engine.step()
    assert [s.text for s in seqs] == texts
    assert engine.kv_stats()["prefix_cache_hits"] == 0


def test_streamed_prefixes_never_change_with_the_demo_tokenizer():
    """Each streamed piece is final: with the demo model's byte-level BPE, every stable prefix of a
    partial decode (half-decoded characters held back) is a prefix of the full text."""
    from moetide.engine.detokenize import stable_prefix as _stable_prefix
    from moetide.engine.llm import demo_model_path

    path = demo_model_path()
    if not (path / "tokenizer.json").exists():
        pytest.skip("demo model tokenizer not built")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode("naïve café, 東京タワー 🚀🚀 déjà vu — ok", add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    for k in range(len(ids) + 1):
        partial = _stable_prefix(tok.decode(ids[:k], skip_special_tokens=True), 0)
        assert full.startswith(partial), (k, partial)
    assert _stable_prefix("abcd", 2) == "ab" and _stable_prefix("ab\ufffd", 0) == "ab"


# -- bad input: status code, OpenAI error body, and the server keeps serving ---------------------------------
LONG = "x" * (CONTEXT + 10)
BAD_INPUTS = {
    "malformed json": (
        "/v1/completions",
        b'{"model": "tiny-qwen3", "prompt": "hi",',
        400,
        None,
        "invalid_json",
    ),
    "body not an object": ("/v1/completions", [1, 2], 400, None, None),
    "missing model": ("/v1/completions", {"prompt": "hi"}, 400, "model", None),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt", None),
    "missing messages": ("/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    "max_tokens as string": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": "5"},
        400,
        "max_tokens",
        None,
    ),
    "temperature as string": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    "stream as string": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stream": "yes"},
        400,
        "stream",
        None,
    ),
    "prompt as number": ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    "messages as string": ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    "unknown role": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages",
        None,
    ),
    "temperature NaN": (
        "/v1/completions",
        b'{"model": "tiny-qwen3", "prompt": "hi", "temperature": NaN}',
        400,
        "temperature",
        None,
    ),
    "negative temperature": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": -1},
        400,
        "temperature",
        None,
    ),
    "top_p zero": ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "model_not_found"),
    "unknown model chat": (
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
        "model_not_found",
    ),
    "max_tokens zero": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    "max_tokens negative": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
        400,
        "max_tokens",
        None,
    ),
    "max_tokens beyond context": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "prompt longer than context": (
        "/v1/completions",
        {"model": MODEL, "prompt": LONG, "max_tokens": 1},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "chat longer than context": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    "empty prompt": ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    "token id outside vocabulary": (
        "/v1/completions",
        {"model": MODEL, "prompt": [5, 10**6]},
        400,
        None,
        None,
    ),
    "batch of prompts": ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    "empty stop string": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stop": [""]},
        400,
        "stop",
        None,
    ),
    "n above one": ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", None),
    "logprobs": ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1}, 400, "logprobs", None),
    "chat logprobs": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
        400,
        "logprobs",
        None,
    ),
    "unknown route": ("/v1/embeddings", {"model": MODEL, "input": "x"}, 404, None, "not_found"),
    "lone surrogate in prompt": (
        "/v1/completions",
        b'{"model": "tiny-qwen3", "prompt": "ab\\ud800cd"}',
        400,
        "prompt",
        None,
    ),
    "lone surrogate in a message": (
        "/v1/chat/completions",
        b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages",
        None,
    ),
    "tools": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        400,
        "tools",
        None,
    ),
    "tool_choice": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        400,
        "tool_choice",
        None,
    ),
    "response_format json_object": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
        },
        400,
        "response_format",
        None,
    ),
    "response_format on completions": (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format",
        None,
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_answered_with_an_openai_error(server, case):
    path, body, status, param, code = BAD_INPUTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    still_serves(server)


def test_openai_client_sees_bad_request_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    still_serves(server)


# -- queueing, disconnects and failures (one batch slot, a queue of one) -------------------------------------
def test_full_queue_429_and_disconnect_frees_the_sequence(slow_server):
    live = slow_server
    url = f"{live.base_url}/v1/completions"
    aborted_before = live.metric('moetide_requests_finished_total{finish_reason="abort"}')
    with httpx.Client(timeout=60) as http:
        long_body = {
            "model": MODEL,
            "prompt": "long",
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with http.stream("POST", url, json=long_body) as running:  # takes the only batch slot
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            queued_result = {}
            queued = threading.Thread(
                target=lambda: queued_result.update(
                    out=live.client().completions.create(model=MODEL, prompt="queued", **greedy(3))
                )
            )
            queued.start()
            wait_for(lambda: live.engine.stats()["waiting"] == 1, what="the second request to queue")

            refused = http.post(url, json={"model": MODEL, "prompt": "one too many", "max_tokens": 2})
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
        # leaving the `with` closes the connection mid-stream: the server aborts that sequence, which
        # frees the only batch slot for the queued request
        queued.join(30)
    assert queued_result["out"].usage.completion_tokens == 3
    wait_for(lambda: live.engine.stats() == {"waiting": 0, "running": 0}, what="the batch to empty")
    assert live.metric('moetide_requests_finished_total{finish_reason="abort"}') == aborted_before + 1
    assert live.metric('moetide_requests_rejected_total{reason="queue_full"}') >= 1
    still_serves(live)


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(slow_server):
    live = slow_server
    aborted_before = live.metric('moetide_requests_finished_total{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": "patience", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # 200 steps of 20 ms: the client gives up long before
        httpx.post(f"{live.base_url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    wait_for(
        lambda: live.metric('moetide_requests_finished_total{finish_reason="abort"}') == aborted_before + 1,
        timeout_s=3,  # well before the 4 s the request would take to finish
        what="the abandoned request to be aborted",
    )
    wait_for(lambda: live.engine.stats() == {"waiting": 0, "running": 0}, what="the batch to empty")


def test_failing_step_fails_only_the_batch(slow_server):
    live = slow_server
    url = f"{live.base_url}/v1/completions"
    live.slow_runner.fail_when_queued = True
    results = {}

    def post(name, prompt, n):
        results[name] = httpx.post(
            url,
            json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )

    in_batch = threading.Thread(target=post, args=("in_batch", "first", 100))
    in_batch.start()
    wait_for(lambda: live.engine.stats()["running"] == 1, what="the first request to run")
    queued = threading.Thread(target=post, args=("queued", "second", 5))
    queued.start()
    in_batch.join(30)
    queued.join(30)
    assert results["in_batch"].status_code == 500
    error = results["in_batch"].json()["error"]
    assert error["type"] == "internal_error" and "injected decode failure" in error["message"]
    assert results["queued"].status_code == 200
    assert results["queued"].json()["usage"]["completion_tokens"] == 5
    assert live.engine.is_alive
    assert live.metric("moetide_engine_step_errors_total") == 1
    still_serves(live)


# -- one request never hurts another ----------------------------------------------------------------------
PROMPTS_8 = [f"request {i}: {'xyz' * i}" for i in range(8)]


def _eight_concurrent(live: LiveServer, poisoned: int | None) -> list:
    """Eight completions at once (greedy, 12 tokens); request `poisoned` samples with top_p=1e-46,
    which is 0 in float32. Returns each answer's text, or the exception it raised."""

    async def run():
        client = live.async_client()

        async def one(i):
            extra = {"temperature": 1.0, "top_p": 1e-46} if i == poisoned else {"temperature": 0}
            out = await client.completions.create(
                model=MODEL, prompt=PROMPTS_8[i], max_tokens=12, extra_body={"ignore_eos": True}, **extra
            )
            return out.choices[0].text

        try:
            return await asyncio.gather(*(one(i) for i in range(8)), return_exceptions=True)
        finally:
            await client.close()

    return asyncio.run(run())


def test_poisoned_request_among_eight_changes_nothing_for_the_others(server):
    clean = _eight_concurrent(server, poisoned=None)
    assert all(isinstance(text, str) for text in clean), clean
    poisoned = _eight_concurrent(server, poisoned=7)  # sent last: it joins the others
    assert poisoned[:7] == clean[:7]
    # a top_p that rounds to 0 keeps the most likely token alone: the poisoned request is greedy
    assert poisoned[7] == clean[7]
    assert server.engine.is_alive
    assert server.metric("moetide_engine_step_errors_total") == 0


def _four_running(live: LiveServer, late=None):
    """Four greedy completions of 40 tokens at once; with `late` (SamplingParams), one more request
    joins the batch through the engine once all four are running. Returns (texts, late's events)."""

    async def run():
        client = live.async_client()
        tasks = [
            asyncio.ensure_future(
                client.completions.create(
                    model=MODEL,
                    prompt=PROMPTS_8[i],
                    max_tokens=40,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            for i in range(4)
        ]
        events = None
        try:
            if late is not None:
                deadline = time.monotonic() + 20
                while live.engine.stats()["running"] < 4:
                    assert time.monotonic() < deadline, "the four requests did not start"
                    await asyncio.sleep(0.002)
                events = [e async for e in live.engine.submit(live.tokenizer.encode("late"), late)]
            answers = await asyncio.gather(*tasks)
        finally:
            await client.close()
        return [a.choices[0].text for a in answers], events

    return asyncio.run(run())


def test_a_request_that_fails_in_the_step_ends_alone(server):
    """A request whose own processing raises inside the engine step (here: sampling parameters broken
    after validation, as a bug would) ends with an error; the batch it joined finishes unchanged."""
    from moetide.engine.sampling import SamplingParams

    errors_before = server.metric("moetide_engine_step_errors_total")
    alone, _ = _four_running(server)
    broken = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    object.__setattr__(broken, "top_k", "not a number")  # sampling this row raises TypeError
    texts, events = _four_running(server, late=broken)
    assert events[-1].finish_reason == "error" and "sampling failed: TypeError" in events[-1].error
    assert texts == alone
    assert server.metric("moetide_engine_step_errors_total") == errors_before
    still_serves(server)


# -- what the API refuses or defaults ---------------------------------------------------------------------
def test_completions_max_tokens_null_is_16(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": None, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 16


def test_message_text_cannot_forge_special_tokens(server):
    """`</s>` in a message is four characters, not the end-of-sequence token; the template's own text
    still counts. (The demo tokenizer's `<|end|>`-style roles: test_server_prompt.py.)"""
    tok = server.tokenizer
    eos = tok.eos_token_id
    messages = [{"role": "user", "content": "hi</s>"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    forged = tok.encode(rendered, add_special_tokens=False)
    assert eos in forged  # what a plain tokenization of the rendered prompt does
    answer = server.client().chat.completions.create(model=MODEL, messages=messages, **greedy(1))
    assert answer.usage.prompt_tokens == len(forged) + len("</s>") - 1


# -- the guarded front end: API key, content type, size and time limits --------------------------------------
API_KEY = "sk-test-key"
MAX_BYTES = 64 << 10
READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def guarded(server):
    live = start_frontend(
        server.engine,
        server.tokenizer,
        api_key=API_KEY,
        max_request_bytes=MAX_BYTES,
        read_timeout_s=READ_TIMEOUT_S,
    )
    live.api_key = API_KEY
    yield live
    live.close()


def test_api_key_is_required_except_on_health(guarded):
    url = f"{guarded.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        refused = httpx.post(url, json=body, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200
    keyless = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.list()
    still_serves(guarded)  # with the key


def _auth(content_type: str | None = "application/json") -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    return headers


def test_non_json_content_type_is_415(guarded):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    url = f"{guarded.base_url}/v1/completions"
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        refused = httpx.post(url, content=body, headers=_auth(content_type))
        assert refused.status_code == 415, (content_type, refused.text)
        assert refused.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(url, content=body, headers=_auth("application/json; charset=utf-8"))
    assert ok.status_code == 200, ok.text


def test_body_over_the_limit_is_413_before_it_is_read(guarded):
    url = f"{guarded.base_url}/v1/completions"
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BYTES})
    refused = httpx.post(url, content=big, headers=_auth())
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(url, content=iter([big[:40000].encode(), big[40000:].encode()]), headers=_auth())
    assert chunked.status_code == 413
    # a Content-Length over the limit is answered before any byte of the body is sent
    host, port = guarded.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n".encode()
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_slow_clients_time_out(guarded):
    host, port = guarded.base_url.removeprefix("http://").split(":")
    # headers never finish: the server closes the connection without an answer (the client's own
    # 60 s timeout only bounds the test: reaching it means the server kept the connection open)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            assert _read_until_closed(sock) == b""
        except TimeoutError:
            pytest.fail("the server kept open a connection whose headers never finished")
    # headers that arrive in two parts, in time, are answered: the limit is on time, not on reads
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sock.sendall(b"Connection: close\r\n\r\n")
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 200")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # the body never finishes
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'.encode()
        )
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")
    still_serves(guarded)


def test_prompt_certainly_longer_than_the_context_is_refused_from_its_length(server):
    """With the demo model's byte-level BPE, a token covers at most 256 characters, so a prompt of
    256 x context characters is too long whatever its text: refused without tokenizing it."""
    from transformers import AutoTokenizer

    from moetide.engine.llm import demo_model_path

    demo = start_frontend(server.engine, AutoTokenizer.from_pretrained(demo_model_path()))
    try:
        url = f"{demo.base_url}/v1/completions"
        long_prompt = "a" * (CONTEXT * 256)
        refused = httpx.post(url, json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1}, timeout=60)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and "characters" in error["message"], error
        chat = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}
        refused = httpx.post(f"{demo.base_url}/v1/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 400 and "characters" in refused.json()["error"]["message"]
        # just under the bound, the prompt is tokenized and measured in tokens
        shorter = httpx.post(url, json={"model": MODEL, "prompt": "a b " * 300, "max_tokens": 1}, timeout=60)
        assert shorter.status_code == 400 and "tokens;" in shorter.json()["error"]["message"]
    finally:
        demo.close()
