"""Serving benchmark: throughput and TTFT/TPOT at 1, 8 and 32 concurrent streaming clients.

Starts `moetide serve` as a child process (its own interpreter, so the clients' Python does not share
a GIL with the engine) with every option this script does not know forwarded to it, or connects to
a running server with --url. Each level runs `concurrency` closed-loop clients; each client sends
`--requests-per-client` streaming chat requests one after another, with a fixed output length
(`ignore_eos`). Prompts are the first user turns of the held-out ShareGPT conversations
(`moetide.data.sharegpt.heldout_conversations`) or lines of --prompts FILE.

Per request, from the arrival times of streamed chunks:
    TTFT = first chunk with text - request sent
    TPOT = (last chunk - first chunk) / (output tokens - 1)
Per level: output tokens/s = all output tokens / level wall time; TTFT and TPOT percentiles; the
change in the server's expert counters (stall seconds, bytes moved) and its hit rate at the end.

Prefix probe (`--prefix-probe-tokens N`): before the levels, pairs of requests that share a system
prompt of about N tokens, each pair a new one; the first of a pair fills the prefix cache, the
second finds it there. Reported: median TTFT of the seconds / of the firsts, and the change in the
server's `moetide_prefix_cache_{queries,hits}_total`.

Example (the H200 run):
    python scripts/bench_server.py --out bench_server.json -- --gpu-memory 8GiB --policy combined
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx


@dataclass
class RequestRecord:
    concurrency: int
    prompt_chars: int
    prompt_tokens: int | None
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float
    error: str | None = None
    sent_at: float | None = None  # time.perf_counter() when the request was sent


# -- prompts -------------------------------------------------------------------------------------------------
def load_prompts(path: str | None, max_chars: int) -> list[str]:
    """Prompts from a file (one per line, or JSONL with a "prompt" field) or the held-out ShareGPT set."""
    prompts: list[str] = []
    if path:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                line = json.loads(line).get("prompt", "")
            prompts.append(line)
    else:
        from moetide.data.sharegpt import heldout_conversations

        for conversation in heldout_conversations():
            first_user = next((text for role, text in conversation["turns"] if role == "user"), None)
            if first_user and first_user.strip():
                prompts.append(first_user.strip())
    prompts = [p[:max_chars] for p in prompts if p]
    if not prompts:
        raise SystemExit("no prompts: give --prompts FILE")
    return prompts


# -- the server ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    serve_args: list[str], timeout_s: float, server_src: str | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "moetide.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *serve_args,
    ]
    print("[bench] starting:", " ".join(cmd), file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if server_src:  # another version's source tree first on the server's path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (server_src, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"moetide serve exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"moetide serve did not come up within {timeout_s:.0f} s")


def scrape(url: str) -> dict[str, float]:
    """The unlabelled series of /metrics (plus resident experts per precision)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(moetide_[a-z_]+)(\{precision=\"(\w+)\"\})? (\S+)$", line)
        if m:
            name = m.group(1) + (f"[{m.group(3)}]" if m.group(3) else "")
            out[name] = float(m.group(4))
    return out


# -- one request, one level ------------------------------------------------------------------------------------
async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, args, concurrency: int, system: str | None = None
) -> RequestRecord:
    """One streamed request over plain HTTP + SSE (httpx only, so the GPU machine needs no openai
    client); chunk arrival times give TTFT and TPOT, the final usage chunk the token counts."""
    body = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.word_ids:  # a model with a word-per-id tokenizer (random weights): the text's words as ids
        prompt = [zlib.crc32(word.encode()) % args.word_ids for word in prompt.split()]
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        if system is not None:
            body["messages"].insert(0, {"role": "system", "content": system})
    else:
        path, body["prompt"] = "/v1/completions", prompt
    sent = time.perf_counter()
    first = last = None
    usage = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise httpx.HTTPStatusError(
                    f"HTTP {response.status_code}: {detail}", request=response.request, response=response
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text = (
                        (choice.get("delta") or {}).get("content")
                        if args.endpoint == "chat"
                        else choice.get("text")
                    )
                    if text:
                        first = first if first is not None else now
                        last = now
    except httpx.HTTPError as e:
        return RequestRecord(
            concurrency, len(prompt), None, 0, None, None, time.perf_counter() - sent, str(e), sent
        )
    n = usage["completion_tokens"] if usage else 0
    ttft = first - sent if first is not None else None
    tpot = (last - first) / (n - 1) if first is not None and n > 1 else None
    prompt_tokens = usage["prompt_tokens"] if usage else None
    return RequestRecord(
        concurrency, len(prompt), prompt_tokens, n, ttft, tpot, time.perf_counter() - sent, None, sent
    )


def probe_texts(prompts: list[str], count: int, chars: int) -> list[str]:
    """`count` texts of `chars` characters, each from its own prompts (no two share a first block)."""
    texts, i = [], 0
    for _ in range(count):
        text = ""
        while len(text) < chars:
            text += prompts[i % len(prompts)] + "\n"
            i += 1
        texts.append(text[:chars])
    return texts


QUERIES, HITS = "moetide_prefix_cache_queries_total", "moetide_prefix_cache_hits_total"


async def fit_text(ask, text: str, tokens: int) -> str:
    """`text` cut to about `tokens` tokens, at its own characters per token (measured on two copies
    that start differently, so they leave the server no usable prefix)."""
    third, sixth = len(text) // 3, len(text) // 6
    longer = await ask("calibration\n" + text[:third])
    shorter = await ask("calibration\n" + text[:sixth])
    counted = (longer.prompt_tokens or 0) - (shorter.prompt_tokens or 0)
    return text[: int((third - sixth) / max(1, counted) * tokens)]


async def prefix_probe(url: str, model: str, prompts: list[str], args) -> dict:
    """TTFT of a request whose long system prompt is new to the server, then of one that shares it."""
    questions = ("Summarize the text above in one sentence.", "What is the main topic of the text above?")
    probe = argparse.Namespace(**{**vars(args), "output_len": 4})
    client = httpx.AsyncClient(base_url=url, timeout=args.request_timeout)

    async def ask(system: str, question: str) -> RequestRecord:
        if args.endpoint == "chat":
            return await one_request(client, model, question, probe, 1, system=system)
        return await one_request(client, model, system + "\n" + question, probe, 1)

    try:
        texts = probe_texts(prompts, args.prefix_probe_pairs, 6 * args.prefix_probe_tokens)
        pairs, queries, hits = [], 0.0, 0.0
        for text in texts:
            text = await fit_text(lambda t: ask(t, questions[0]), text, args.prefix_probe_tokens)
            before = scrape(url)
            first = await ask(text, questions[0])
            second = await ask(text, questions[1])
            after = scrape(url)
            pairs.append({"first": asdict(first), "second": asdict(second)})
            queries += after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)
            hits += after.get(HITS, 0.0) - before.get(HITS, 0.0)
    finally:
        await client.aclose()
    ok = [p for p in pairs if p["first"]["ttft_s"] and p["second"]["ttft_s"]]
    first_ttft = statistics.median(p["first"]["ttft_s"] for p in ok) if ok else None
    second_ttft = statistics.median(p["second"]["ttft_s"] for p in ok) if ok else None

    return {
        "target_tokens": args.prefix_probe_tokens,
        "pairs": pairs,
        "first_ttft_s_median": first_ttft,
        "second_ttft_s_median": second_ttft,
        "ttft_ratio": second_ttft / first_ttft if first_ttft and second_ttft else None,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
    }


async def long_prompt_probe(url: str, model: str, prompts: list[str], args) -> dict:
    """TTFT of short requests that arrive while one long prompt is prefilled, under load.

    `--long-probe-clients` closed-loop clients send short prompts (`--long-probe-output-len` tokens
    out); after `--long-probe-lead-s` one request with a new prompt of about `--long-probe-tokens`
    tokens joins, and 50 ms later `--long-probe-followers` short requests at once: they arrive behind
    it (a chunked prefill lets them in between its chunks). Short requests of the load sent before it
    are the baseline."""
    short_args = argparse.Namespace(**{**vars(args), "output_len": args.long_probe_output_len})
    limits = httpx.Limits(max_connections=args.long_probe_clients + 8)
    client = httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits)
    records: list[RequestRecord] = []
    stop = asyncio.Event()

    async def ask(text: str) -> RequestRecord:
        return await one_request(client, model, text, short_args, 1)

    async def worker(w: int):
        r = 0
        while not stop.is_set():
            prompt = prompts[(w * 997 + r) % len(prompts)]
            records.append(await one_request(client, model, prompt, short_args, args.long_probe_clients))
            r += 1

    try:
        text = probe_texts(prompts[len(prompts) // 3 :], 1, 8 * args.long_probe_tokens)[0]
        text = await fit_text(ask, text, args.long_probe_tokens)
        workers = [asyncio.create_task(worker(w)) for w in range(args.long_probe_clients)]
        await asyncio.sleep(args.long_probe_lead_s)
        long_task = asyncio.create_task(one_request(client, model, text, short_args, args.long_probe_clients))
        await asyncio.sleep(0.05)
        followers = await asyncio.gather(
            *(ask(prompts[(5 * i + 1) % len(prompts)]) for i in range(args.long_probe_followers))
        )
        long_record = await long_task
        stop.set()
        await asyncio.gather(*workers)
    finally:
        await client.aclose()
    start = long_record.sent_at
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    before = [r.ttft_s for r in ok if r.sent_at < start]
    behind = [r.ttft_s for r in followers if r.error is None and r.ttft_s is not None]
    return {
        "target_tokens": args.long_probe_tokens,
        "clients": args.long_probe_clients,
        "long": asdict(long_record),
        "short_before": {"n": len(before), "ttft_p50_s": percentile(before, 0.5),
                         "ttft_p90_s": percentile(before, 0.9)},  # fmt: skip
        "short_behind": {"n": len(behind), "ttft_p50_s": percentile(behind, 0.5),
                         "ttft_p90_s": percentile(behind, 0.9),
                         "ttft_max_s": max(behind) if behind else None},  # fmt: skip
        "errors": sum(r.error is not None for r in records + list(followers)),
    }


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, args, offset: int):
    client = httpx.AsyncClient(
        base_url=url, timeout=args.request_timeout, limits=httpx.Limits(max_connections=concurrency + 4)
    )
    records: list[RequestRecord] = []

    async def worker(w: int):
        for r in range(args.requests_per_client):
            prompt = prompts[(offset + w * args.requests_per_client + r) % len(prompts)]
            records.append(await one_request(client, model, prompt, args, concurrency))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        await client.aclose()
    return records, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(
    concurrency: int, records: list[RequestRecord], wall_s: float, before: dict, after: dict
) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    tokens = sum(r.output_tokens for r in ok)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0) if name in after else None

    return {
        "concurrency": concurrency,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok if r.prompt_tokens)
        if any(r.prompt_tokens for r in ok)
        else None,
        "ttft_s": {q: percentile(ttft, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"mean": statistics.fmean(ttft) if ttft else None},
        "tpot_s": {q: percentile(tpot, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"mean": statistics.fmean(tpot) if tpot else None},
        "expert_lo_runs": delta("moetide_expert_lo_runs_total"),
        "expert_bytes_moved": delta("moetide_expert_bytes_moved_total"),
        "expert_hit_rate_end": after.get("moetide_expert_hit_rate"),
        "preemptions": delta("moetide_preemptions_total"),
        "kv_blocks_total": after.get("moetide_kv_blocks_total"),
        "resident_experts_end": {
            k.split("[")[1][:-1]: v for k, v in after.items() if k.startswith("moetide_resident")
        },
    }


def print_table(levels: list[dict]) -> None:
    def ms(x):
        return f"{x * 1000:8.1f}" if x is not None else "     n/a"

    print(
        f"{'clients':>7} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'req/s':>7} "
        f"{'TTFT p50':>8} {'TTFT p90':>8} {'TPOT p50':>8} {'TPOT p90':>8} {'lo runs':>8} {'GB moved':>9}"
    )
    for lv in levels:
        lo_runs = lv["expert_lo_runs"]
        moved = lv["expert_bytes_moved"]
        print(
            f"{lv['concurrency']:>7} {lv['requests']:>5} {lv['errors']:>4} {lv['output_tokens_per_s']:>10.1f}"
            f" {lv['requests_per_s']:>7.2f} {ms(lv['ttft_s']['p50'])} {ms(lv['ttft_s']['p90'])}"
            f" {ms(lv['tpot_s']['p50'])} {ms(lv['tpot_s']['p90'])}"
            f" {lo_runs if lo_runs is not None else float('nan'):>8.0f}"
            f" {(moved or 0) / 1e9:>9.2f}"
        )
    print("(TTFT/TPOT in ms, measured at the client from streamed chunk arrival times)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Other options go to `moetide serve`."
    )
    parser.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    parser.add_argument(
        "--model-name", default=None, help="`model` to request (default: the server's first model)"
    )
    parser.add_argument(
        "--server-src",
        default=None,
        help="run `moetide serve` from this source directory (a checkout of another version: A/B runs)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--prompts", default=None, help="prompt file (one per line, or JSONL with 'prompt')")
    parser.add_argument(
        "--word-ids",
        type=int,
        default=0,
        metavar="VOCAB",
        help="send each prompt as token ids, a word's id its CRC-32 mod VOCAB (completions; for"
        " synthetic checkpoints, whose word tokenizer maps real words to one unknown id)",
    )
    parser.add_argument(
        "--max-prompt-chars", type=int, default=2000, help="prompts are cut to this many characters"
    )
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument(
        "--prefix-probe-tokens", type=int, default=0, help="shared system prompt length for the prefix probe"
    )
    parser.add_argument("--prefix-probe-pairs", type=int, default=3)
    parser.add_argument(
        "--long-probe-tokens",
        type=int,
        default=0,
        help="length of the long prompt that joins a load of short requests (the long-prompt probe)",
    )
    parser.add_argument("--long-probe-clients", type=int, default=16)
    parser.add_argument(
        "--long-probe-followers", type=int, default=8, help="short requests sent right behind the long one"
    )
    parser.add_argument("--long-probe-output-len", type=int, default=32)
    parser.add_argument(
        "--long-probe-lead-s", type=float, default=2.0, help="seconds of load before the long prompt joins"
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args, serve_args = parser.parse_known_args(argv)
    if args.word_ids and args.endpoint != "completions":
        parser.error("--word-ids sends token ids: use it with --endpoint completions")
    serve_args = [a for a in serve_args if a != "--"]
    if args.url and serve_args:
        parser.error(f"--url given: nothing to forward to moetide serve, but got {' '.join(serve_args)}")

    prompts = load_prompts(args.prompts, args.max_prompt_chars)
    proc = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        proc, url = start_server(serve_args, args.startup_timeout, args.server_src)
    try:
        model = args.model_name or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        if args.warmup_requests:
            warm = argparse.Namespace(**{**vars(args), "requests_per_client": args.warmup_requests})
            asyncio.run(run_level(url, model, prompts, 1, warm, offset=len(prompts) // 2))
        probe = None
        if args.prefix_probe_tokens:
            probe = asyncio.run(prefix_probe(url, model, prompts, args))
            print(
                f"[bench] prefix probe: TTFT {probe['first_ttft_s_median']} s new, "
                f"{probe['second_ttft_s_median']} s shared (ratio {probe['ttft_ratio']}), "
                f"{probe['prefix_cache_hits']:.0f} of {probe['prefix_cache_queries']:.0f} prompt tokens hit",
                file=sys.stderr,
                flush=True,
            )
        long_probe = None
        if args.long_probe_tokens:
            long_probe = asyncio.run(long_prompt_probe(url, model, prompts, args))
            behind, before = long_probe["short_behind"], long_probe["short_before"]
            print(
                f"[bench] long-prompt probe: {long_probe['long']['prompt_tokens']} tokens, TTFT"
                f" {long_probe['long']['ttft_s']} s; short requests behind it: TTFT p50/p90"
                f" {behind['ttft_p50_s']} / {behind['ttft_p90_s']} s (n={behind['n']}), before it"
                f" {before['ttft_p50_s']} / {before['ttft_p90_s']} s",
                file=sys.stderr,
                flush=True,
            )
        levels, all_records = [], []
        for concurrency in args.concurrency:
            before = scrape(url)
            records, wall_s = asyncio.run(run_level(url, model, prompts, concurrency, args, offset=0))
            after = scrape(url)
            levels.append(summarize(concurrency, records, wall_s, before, after))
            all_records += records
            lv = levels[-1]
            print(
                f"[bench] {concurrency} clients: {lv['output_tokens_per_s']:.1f} output tok/s, "
                f"{lv['errors']} errors",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(levels)
    errors = [r.error for r in all_records if r.error]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    if args.out:
        result = {
            "config": {k: v for k, v in vars(args).items() if k != "url"}
            | {"url": args.url, "serve_args": serve_args},
            "model": model,
            "num_prompts": len(prompts),
            "levels": levels,
            "prefix_probe": probe,
            "long_prompt_probe": long_probe,
            "requests": [asdict(r) for r in all_records],
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
