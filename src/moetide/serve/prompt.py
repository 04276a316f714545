"""Prompts to token ids for the server: a cheap length bound before tokenizing, and chat messages
whose text can never become a special token (no role forging).

Both encoders run in the thread pool, never on the event loop.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import uuid

from .errors import APIError

# NFC/NFKC compose at most 4 code points into one (U+1FAF = Ω + 3 combining marks)
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_MAX_COMPOSITION = 4
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}  # never remove a character
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def max_chars_per_token(tokenizer) -> int | None:
    """Characters one token can cover at most, when that is certain; else None.

    Certain for BPE that never drops input (byte-level, or byte fallback) behind normalizers and
    pre-tokenizers that never delete characters: a vocabulary string has at least one character per
    input character it covers (byte-level strings have one per byte). A prompt of `n` characters then
    has at least `n / max_chars_per_token` tokens.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    byte_level = any(p.get("type") == "ByteLevel" for p in _flatten(pre, "pretokenizers"))
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not all(_keeps_characters(p) for p in _flatten(pre, "pretokenizers")):
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return longest * factor


def _flatten(component: dict | None, key: str) -> list[dict]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [leaf for part in component.get(key, []) for leaf in _flatten(part, key)]
    return [component]


def _normalizer_factor(normalizer: dict | None) -> int | None:
    """How many input characters can shrink into one; None if a normalizer may delete characters."""
    factor = 1
    for part in _flatten(normalizer, "normalizers"):
        kind = part.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            factor *= _MAX_COMPOSITION
        elif kind == "Replace" and "String" in (part.get("pattern") or {}) and part.get("content"):
            factor *= max(1, -(-len(part["pattern"]["String"]) // len(part["content"])))
        elif kind not in _KEEPING_NORMALIZERS:
            return None
    return factor


def _keeps_characters(pre_tokenizer: dict) -> bool:
    kind = pre_tokenizer.get("type")
    if kind in ("Split", "Punctuation"):
        return str(pre_tokenizer.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


class PromptEncoder:
    """Token ids for completions prompts and chat messages, with the context's limits.

    Args:
        tokenizer: the checkpoint's (fast) tokenizer.
        context_tokens: the model's context (prompt + output).
    """

    def __init__(self, tokenizer, context_tokens: int):
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.specials = {
            t.content: i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", True)
        }
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)))
            if self.specials
            else None
        )

    @functools.cached_property
    def text_tokenizer(self):
        """A copy that never matches special tokens, made when a message first needs it. A copy, not a
        call argument: transformers keeps that switch on the backend, which other threads share."""
        text_tokenizer = copy.deepcopy(self.tokenizer)
        text_tokenizer.split_special_tokens = True
        return text_tokenizer

    # -- completions ---------------------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        """`prompt` as the completions API allows it -> token ids (special tokens in it count)."""
        if isinstance(prompt, list):
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that is certainly longer than the context, without tokenizing it."""
        per_token = self.max_chars_per_token
        if per_token is None or num_chars < self.context_tokens * per_token:
            return
        raise APIError(
            400,
            f"the {param} has {num_chars} characters, so at least {num_chars // per_token} tokens; this"
            f" model's context holds {self.context_tokens} tokens (prompt + output): shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )

    # -- chat ------------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        """`[{"role", "content"}]` -> token ids through the chat template; special-token text inside
        a message's content is tokenized as text, so a user cannot forge a role or an end of turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        text = self._render(messages)
        if self._special_re is None or not any(self._special_re.search(m["content"]) for m in messages):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._encode_with_text_spans(text, self._content_spans(messages, text))

    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. roles must alternate)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None

    def _content_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Where each message's content sits in the rendered `text`: render once more with unguessable
        markers as contents, and accept only if putting the contents back gives `text` exactly."""
        nonce = uuid.uuid4().hex
        marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
        marked = self._render([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)])
        pieces = re.split(f"\x00{nonce}:(\\d+)\x00", marked)
        rebuilt, spans = pieces[0], []
        for index, after in zip(pieces[1::2], pieces[2::2], strict=True):
            content = messages[int(index)]["content"]
            spans.append((len(rebuilt), len(rebuilt) + len(content)))
            rebuilt += content + after
        if rebuilt != text:
            raise APIError(
                400,
                "a message contains the text of one of this model's special tokens, and its chat"
                " template changes message text, so it cannot be kept apart: remove the special token",
                param="messages",
            )
        return spans

    def _encode_with_text_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Special tokens count only outside `spans`; everything between them is tokenized as text."""
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            if any(a < match.end() and match.start() < b for a, b in spans):
                continue  # inside (or across the edge of) a message's content: plain text
            if match.start() > start:
                ids += self.text_tokenizer.encode(text[start : match.start()], add_special_tokens=False)
            ids.append(self.specials[match.group()])
            start = match.end()
        if start < len(text):
            ids += self.text_tokenizer.encode(text[start:], add_special_tokens=False)
        return ids
