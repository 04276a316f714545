"""Where a prefill step's time goes: a ~1,000-token prompt new to the prefix cache, then one that
shares it, in one process through `moetide.LLM` (no server), per policy.

For each (model, policy) and each of --pairs fresh prompts: wall time of `generate(max_tokens=1)` for
the new prompt and for one sharing its first `--tokens` tokens, split into the runner's forward (timed
to a device sync) and the rest of the engine step; then cProfile of one shared-prefix request (the
functions with the most own time).

Example (H200):
    python scripts/profile_prefill.py --out prefill.json --config demo:combined:1GiB \\
        --config /tmp/moetide-synthetic/olmoe-1b-7b:combined:4GiB
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

import moetide
from moetide.data.sharegpt import heldout_conversations


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_runner(llm, log: list):
    """Wrap the runner's prefill so each call's forward time (to a device sync) lands in `log`."""
    runner = llm.engine.runner
    inner = runner.prefill

    def prefill(chunks):
        sync()
        t0 = time.perf_counter()
        out = inner(chunks)
        sync()
        log.append((sum(n for _, n in chunks), time.perf_counter() - t0))
        return out

    runner.prefill = prefill


def texts_as_ids(tokenizer, count: int, tokens: int) -> list[list[int]]:
    out, buf = [], []
    for conv in heldout_conversations():
        for _, text in conv["turns"]:
            buf += tokenizer.encode(text, add_special_tokens=False)
            if len(buf) >= tokens:
                out.append(buf[:tokens])
                buf = []
                if len(out) == count:
                    return out
    raise SystemExit("not enough held-out text")


def one(llm, ids: list[int], log: list) -> dict:
    params = moetide.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    log.clear()
    sync()
    t0 = time.perf_counter()
    llm.generate([ids], params)
    sync()
    wall = time.perf_counter() - t0
    forward = sum(t for _, t in log)
    return {"prompt_tokens": len(ids), "wall_s": wall, "forward_s": forward, "steps": list(log)}


def profile(llm, config: str, args) -> dict:
    log: list = []
    timed_runner(llm, log)
    tok = llm.tokenizer
    texts = texts_as_ids(tok, args.pairs + 2, args.tokens + 2 * args.tail)
    # warm-up: a long prompt and a shared one (first captures, kernels' first shapes)
    for ids in texts[:2]:
        one(llm, ids, log)
        one(llm, ids[: args.tokens] + ids[-args.tail :], log)
    pairs = []
    for ids in texts[2:]:
        first = one(llm, ids[: args.tokens + args.tail], log)
        second = one(llm, ids[: args.tokens] + ids[-args.tail :], log)
        short = one(llm, ids[-args.tail :], log)
        pairs.append({"first": first, "second": second, "short": short})
    ids = texts[2][: args.tokens] + list(reversed(texts[2][-args.tail :]))
    prof = cProfile.Profile()
    prof.enable()
    one(llm, ids, log)
    prof.disable()
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(args.top)
    med = lambda key, field: statistics.median(p[key][field] for p in pairs)  # noqa: E731
    summary = {
        "config": config,
        "first_wall_s": med("first", "wall_s"),
        "second_wall_s": med("second", "wall_s"),
        "short_wall_s": med("short", "wall_s"),
        "first_forward_s": med("first", "forward_s"),
        "second_forward_s": med("second", "forward_s"),
        "ratio": med("second", "wall_s") / med("first", "wall_s"),
    }
    print(json.dumps(summary), flush=True)
    return summary | {"pairs": pairs, "cprofile_shared": stream.getvalue()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", action="append", required=True, help="MODEL:POLICY[:BUDGET] (demo = embedded)")
    ap.add_argument("--tokens", type=int, default=1000, help="shared prefix length")
    ap.add_argument("--tail", type=int, default=16, help="tokens after the shared prefix")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    results = []
    for config in args.config:
        model, policy, *budget = config.split(":")
        llm = moetide.LLM(
            None if model == "demo" else model, policy=policy, gpu_memory=budget[0] if budget else None
        )
        try:
            results.append(profile(llm, config, args))
        finally:
            llm.close()
    report = {"command": " ".join(sys.argv), "torch": torch.__version__, "results": results}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
