"""Prompts to token ids for the server: a cheap length bound before tokenizing, and chat messages
through the library's encoder (their text can never become a special token: no role forging).

Both run in the server's preparation threads (serve/api.py), never on the event loop; a set
`cancel` event (the client went away) stops them between steps.
"""

from __future__ import annotations

import json
import threading

from ..engine.chat import ChatEncoder, ChatEncodingError, EncodingCancelled
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

    Chat goes through the library's encoder (`engine/chat.py`: special-token text in a message stays
    text, the message count is capped); its refusals become 400s here.

    Args:
        tokenizer: the checkpoint's (fast) tokenizer.
        context_tokens: the model's context (prompt + output).
    """

    def __init__(self, tokenizer, context_tokens: int):
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.chat = ChatEncoder(tokenizer)

    # -- completions ---------------------------------------------------------------------------------------
    def encode_prompt(self, prompt, cancel: threading.Event | None = None) -> list[int]:
        """`prompt` as the completions API allows it -> token ids (special tokens in it count)."""
        if isinstance(prompt, list):
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            if cancel is not None and cancel.is_set():
                raise EncodingCancelled()
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
    def encode_chat(self, messages: list[dict], cancel: threading.Event | None = None) -> list[int]:
        """`[{"role", "content"}]` -> token ids through the chat template (`ChatEncoder.encode`)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            return self.chat.encode(messages, cancel=cancel)
        except ChatEncodingError as e:
            raise APIError(400, str(e), param=e.param) from None
