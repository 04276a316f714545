"""What a benchmark sends: prompts (token ids), output lengths and arrival times.

Prompts come from the first user turn of the shipped held-out ShareGPT conversations (never trained
on), chat-templated with the model's tokenizer when it has a template, cut to `max_input_len` tokens.
Models with random weights (`--synthetic`) get random token ids of the *lengths* those prompts have
under the demo model's tokenizer, so input lengths follow ShareGPT without meaningless tokenization.
A text file (one prompt per line, or JSONL with a "prompt" field) can replace ShareGPT.

Arrivals: all at t = 0 (offline), Poisson at a rate (exponential gaps, seeded), or a CSV of
`arrival_s,input_len,output_len` rows (header optional).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class BenchRequest:
    """One request: prompt token ids, output tokens to generate (EOS ignored), arrival (seconds after start)."""

    prompt_ids: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0


def _chat_prompt(tokenizer, text: str, max_input_len: int) -> list[int]:
    """Chat-templated ids of one user turn; a long text is cut (before templating) until it fits."""
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(t: str) -> list[int]:
        if not has_template:
            return list(tokenizer.encode(t, add_special_tokens=True))
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    ids = encode(text)
    while len(ids) > max_input_len and len(text) > 1:
        text = text[: max(1, int(len(text) * max_input_len / len(ids) * 0.95))]
        ids = encode(text)
    return ids[:max_input_len]


def heldout_user_turns(count: int) -> list[str]:
    """First user turn of the first `count` held-out conversations (cycled if fewer exist)."""
    from ..data.sharegpt import heldout_conversations

    texts = []
    for c in heldout_conversations():
        user = next((t for role, t in c["turns"] if role == "user" and t.strip()), None)
        if user is not None:
            texts.append(user)
    if not texts:
        raise ConfigError("the held-out split has no user turns")
    return [texts[i % len(texts)] for i in range(count)]


def read_prompt_file(path: str | Path, count: int) -> list[str]:
    """Prompts from a text file (one per line) or JSONL (`{"prompt": ...}` per line), cycled to `count`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                texts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"--prompts {path}: every JSONL line needs a 'prompt' field") from None
        else:
            texts.append(line)
    if not texts:
        raise ConfigError(f"--prompts {path}: the file holds no prompt")
    return [texts[i % len(texts)] for i in range(count)]


def text_prompts(
    tokenizer, count: int, max_input_len: int, prompt_file: str | None = None
) -> list[list[int]]:
    """`count` prompts tokenized with `tokenizer` (chat template if it has one), at most `max_input_len` ids."""
    texts = read_prompt_file(prompt_file, count) if prompt_file else heldout_user_turns(count)
    return [_chat_prompt(tokenizer, t, max_input_len) for t in texts]


def demo_prompt_lengths(count: int, max_input_len: int, prompt_file: str | None = None) -> list[int]:
    """Lengths of the same prompts under the demo model's tokenizer (for random-weight models)."""
    from ..engine.llm import demo_model_path
    from ..models.checkpoint import load_tokenizer

    return [
        len(p) for p in text_prompts(load_tokenizer(demo_model_path()), count, max_input_len, prompt_file)
    ]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (3..vocab-1: 0-2 are bos/eos/pad in synthetic checkpoints) of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def fit_length(ids: list[int], length: int) -> list[int]:
    """`ids` cut or repeated to exactly `length` tokens (for arrival files that fix input lengths)."""
    if length < 1:
        raise ConfigError(f"an input length must be >= 1, got {length}")
    reps = -(-length // max(len(ids), 1))
    return (list(ids) * reps)[:length]


def poisson_arrivals(count: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate_per_s`, first arrival at the first gap."""
    if rate_per_s <= 0:
        raise ConfigError(f"--rate must be > 0 requests/s, got {rate_per_s}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def read_arrivals_csv(path: str | Path) -> list[tuple[float, int, int]]:
    """`[(arrival_s, input_len, output_len)]` sorted by arrival, from a CSV (header row optional)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--arrivals {path}: no such file")
    rows = []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.reader(f)):
            if not row or not "".join(row).strip() or row[0].strip().startswith("#"):
                continue
            try:
                arrival, n_in, n_out = float(row[0]), int(row[1]), int(row[2])
            except (ValueError, IndexError):
                if i == 0:
                    continue  # header
                raise ConfigError(
                    f"--arrivals {path}: line {i + 1} must be 'arrival_s,input_len,output_len', got {row}"
                ) from None
            if arrival < 0 or n_in < 1 or n_out < 1:
                raise ConfigError(f"--arrivals {path}: line {i + 1} needs arrival >= 0 and lengths >= 1")
            rows.append((arrival, n_in, n_out))
    if not rows:
        raise ConfigError(f"--arrivals {path}: no request rows")
    return sorted(rows)


def build_requests(
    prompts: list[list[int]], output_len: int, arrivals: list[float] | None = None
) -> list[BenchRequest]:
    arrivals = arrivals or [0.0] * len(prompts)
    return [BenchRequest(tuple(p), output_len, a) for p, a in zip(prompts, arrivals, strict=True)]


def requests_from_arrivals(
    prompts: list[list[int]], rows: list[tuple[float, int, int]]
) -> list[BenchRequest]:
    """One request per CSV row: prompt i cut or repeated to the row's input length."""
    return [
        BenchRequest(tuple(fit_length(prompts[i % len(prompts)], n_in)), n_out, a)
        for i, (a, n_in, n_out) in enumerate(rows)
    ]
