"""Fairness under hostile input: does one adversarial request slow everyone else's stream?

For each kind of bound the server keeps (`KINDS`), one run has 8 normal streaming chat requests
(greedy, `ignore_eos`, `--tokens` each, through the `openai` client) and, once every one of them has
its first token, a ninth client: in the control run a benign request of the same shape, in the
adversarial run the hostile one. The figure per run is the median over the 8 streams of
TPOT = (last chunk - first chunk) / (output tokens - 1), from chunk arrival times at the client;
the kind's ratio is adversarial / control, two runs of the same server in the same process. The
ninth client's own request is left (disconnected) when the 8 streams end.

    stop_list      the issue's reproducer grown to the size limit: ~700,000 stop strings (8 MiB),
                   `ignore_eos`, 1,900 tokens; refused, the ninth client then streams with the largest
                   stop list allowed
                   (MAX_STOP_STRINGS strings of MAX_STOP_STRING_CHARS characters, none matching)
    special_chat   MAX_CHAT_MESSAGES messages whose content is `<|end|>` x 32 (a check of every
                   special-token match against every message was quadratic); answered 400 (longer
                   than the context) once encoded; control: the same messages with plain text
    message_count  the issue's largest reproducer: 8,000 messages whose content is `<|end|>` (340 KB;
                   over MAX_CHAT_MESSAGES); control: one message of plain text of the same size
                   (tokenized, then answered 400: longer than the context)

The tests (tests/test_fairness.py) run `measure_kind` against a server in their own process; this
script starts `moetide serve` on the demo model as a child process (its own interpreter) unless
--url is given, measures every kind and writes the raw JSON:

    python scripts/bench_adversarial.py --out results/adversarial_cpu_2026-12-07.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from moetide.engine.chat import MAX_CHAT_MESSAGES
from moetide.engine.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from moetide.serve.http import DEFAULT_MAX_REQUEST_BYTES

KINDS = ("stop_list", "special_chat", "message_count")
GOAL = 1.5  # the normal streams' TPOT with the adversarial ninth request / with the benign one, at most
STREAMS = 8
TOKENS = 96


@dataclass
class Ninth:
    """The ninth client's requests, serialized before the run (so that building them costs the
    server's process nothing when the client shares it): sent in order, each next one only after the
    one before was refused (4xx); a 200 stream is read until the normal streams end."""

    path: str
    bodies: list[bytes]
    stream: bool


@dataclass
class Run:
    tpot_s: list[float]  # per normal stream
    ninth_status: list[int] = field(default_factory=list)  # HTTP status of each ninth request sent
    ninth_first_answer_s: float | None = None  # the ninth client's first answer (status), after sending
    wall_s: float = 0.0

    @property
    def median_tpot_s(self) -> float:
        return statistics.median(self.tpot_s)


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def ninth_request(kind: str, model: str, *, adversarial: bool, tokens: int = TOKENS) -> Ninth:
    """The ninth client's requests for `kind` (module docstring): hostile, or the benign control."""
    chat = "/v1/chat/completions"
    hello = [{"role": "user", "content": "Tell me about the sea."}]
    if kind == "stop_list":
        streaming = {
            "model": model,
            "messages": hello,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            "max_tokens": 1900,
        }
        if not adversarial:
            return Ninth(chat, [_json(streaming)], stream=True)
        huge = [f"s{i:07d}" for i in range((DEFAULT_MAX_REQUEST_BYTES - 400) // len('"s0000000",'))]
        widest = ["\x01" * (MAX_STOP_STRING_CHARS - 3) + f"{i:03d}" for i in range(MAX_STOP_STRINGS)]
        return Ninth(chat, [_json({**streaming, "stop": huge}), _json({**streaming, "stop": widest})], True)
    if kind == "special_chat":
        content = "<|end|>" * 32 if adversarial else "x" * len("<|end|>" * 32)
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": content} for i in range(MAX_CHAT_MESSAGES)]
        return Ninth(chat, [_json({"model": model, "messages": messages, "max_tokens": 1})], stream=False)
    if kind == "message_count":
        if adversarial:  # the largest reproducer: 8,000 messages of `<|end|>` (340 KB)
            roles = ("user", "assistant")
            messages = [{"role": roles[i % 2], "content": "<|end|>"} for i in range(8000)]
        else:  # one message of the same size, plain text
            messages = [{"role": "user", "content": "x" * (8000 * len("<|end|>") + 8000 * 30)}]
        return Ninth(chat, [_json({"model": model, "messages": messages, "max_tokens": 1})], stream=False)
    raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


async def _normal_stream(client, model: str, i: int, tokens: int, started: asyncio.Event, first_seen: list):
    """One normal stream: its chunk arrival times -> TPOT (s)."""
    first = last = None
    n = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = now
                first_seen.append(i)
                if len(first_seen) == STREAMS:
                    started.set()
            last = now
    if first is None or n < 2:
        raise RuntimeError(f"normal stream {i} produced {n} tokens")
    return (last - first) / (n - 1)


async def _ninth_client(base_url: str, ninth: Ninth, done: asyncio.Event, run: Run) -> None:
    """Send the ninth requests (see `Ninth`); leave a streaming answer once `done` is set."""
    headers = {"content-type": "application/json", "authorization": "Bearer unused"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for body in ninth.bodies:
            sent = time.perf_counter()
            async with client.stream("POST", ninth.path, content=body, headers=headers) as response:
                if run.ninth_first_answer_s is None:
                    run.ninth_first_answer_s = time.perf_counter() - sent
                run.ninth_status.append(response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    continue
                if not ninth.stream:
                    await response.aread()
                    return
                async for _ in response.aiter_lines():
                    if done.is_set():
                        return  # leaving the stream disconnects: the server aborts the request
                return


async def run_once(base_url: str, model: str, ninth: Ninth, *, tokens: int = TOKENS) -> Run:
    """8 normal streams and, once each has its first token, the ninth client (module docstring)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    started, done, first_seen = asyncio.Event(), asyncio.Event(), []
    run = Run(tpot_s=[])
    start = time.perf_counter()
    normal = [
        asyncio.ensure_future(_normal_stream(client, model, i, tokens, started, first_seen))
        for i in range(STREAMS)
    ]
    await asyncio.wait({asyncio.ensure_future(started.wait()), *normal}, return_when=asyncio.FIRST_COMPLETED)
    ninth_task = asyncio.ensure_future(_ninth_client(base_url, ninth, done, run))
    try:
        run.tpot_s = list(await asyncio.gather(*normal))
    finally:
        done.set()
        run.wall_s = time.perf_counter() - start
        ninth_task.cancel()
        await asyncio.gather(ninth_task, return_exceptions=True)
        await client.close()
    return run


def measure_kind(base_url: str, model: str, kind: str, *, tokens: int = TOKENS, attempts: int = 1) -> dict:
    """Control and adversarial runs of `kind`, `attempts` pairs at most: stops at the first pair
    whose ratio is within GOAL (a shared machine's hiccup can slow one run). The requests are
    serialized before either run."""
    control_ninth = ninth_request(kind, model, adversarial=False, tokens=tokens)
    hostile_ninth = ninth_request(kind, model, adversarial=True, tokens=tokens)
    pairs = []
    for _ in range(attempts):
        control = asyncio.run(run_once(base_url, model, control_ninth, tokens=tokens))
        hostile = asyncio.run(run_once(base_url, model, hostile_ninth, tokens=tokens))
        ratio = hostile.median_tpot_s / control.median_tpot_s
        pairs.append(
            {
                "control": asdict(control),
                "adversarial": asdict(hostile),
                "ratio": ratio,
                "control_median_tpot_s": control.median_tpot_s,
                "adversarial_median_tpot_s": hostile.median_tpot_s,
            }
        )
        if ratio <= GOAL:
            break
    return {"kind": kind, "ratio": min(p["ratio"] for p in pairs), "pairs": pairs}


# -- the benchmark: a child `moetide serve` on the demo model ------------------------------------------------
def start_server(timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`moetide serve` on the demo model (CPU, 16 sequences) on a free loopback port."""
    cmd = [
        sys.executable,
        "-m",
        "moetide.cli",
        "serve",
        "--device",
        "cpu",
        "--max-num-seqs",
        "16",
        "--port",
        "0",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if " on http://" in line:
            return proc, line.rsplit(" on ", 1)[1].strip().removesuffix("/v1")
        if time.monotonic() > deadline:
            break
    proc.terminate()
    raise SystemExit(f"moetide serve did not come up (status {proc.poll()})")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=None, help="a running server (default: start one on the demo model)")
    parser.add_argument("--model", default="moetide-demo", help="the served model name")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to measure")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="output tokens per normal stream")
    parser.add_argument("--repeats", type=int, default=3, help="control/adversarial pairs per kind")
    parser.add_argument("--out", required=True, help="raw JSON written here")
    args = parser.parse_args()
    proc, url = (None, args.url) if args.url else start_server()
    try:
        results = []
        for kind in [k for k in args.kinds.split(",") if k]:
            pairs = [
                measure_kind(url, args.model, kind, tokens=args.tokens)["pairs"][0]
                for _ in range(args.repeats)
            ]
            ratios = [p["ratio"] for p in pairs]
            results.append(
                {"kind": kind, "median_ratio": statistics.median(ratios), "ratios": ratios, "pairs": pairs}
            )
            print(
                f"{kind:14s} ratio median {statistics.median(ratios):.3f} (runs: "
                + ", ".join(f"{r:.3f}" for r in ratios)
                + ")",
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    worst = max(r["median_ratio"] for r in results)
    report = {
        "goal": GOAL,
        "worst_median_ratio": worst,
        "streams": STREAMS,
        "tokens": args.tokens,
        "url": args.url or "moetide serve (demo model, CPU, --max-num-seqs 16)",
        "kinds": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"worst median ratio {worst:.3f} (goal <= {GOAL}); raw JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
