"""Chat messages to token ids through the checkpoint's chat template, one encoder for the library
(`LLM.chat`, `LLM.apply_chat_template`) and the server.

Special-token text inside a message's content is tokenized as text: `<|end|>` written by a user is
seven characters, never the end-of-turn token, so nobody can forge a role; so is a special token that
a message's text completes with the template's text around it (content `end` between a template's
`<|` and `|>`). The template's own special tokens count. Under a template that changes message text
(trims it, say) contents cannot be located: a message holding a whole special token is refused, and
one that only begins or ends like part of one is encoded as the tokenizer reads the rendered text.
The work is linear in the prompt: two renders of the template, one pass over
the special-token matches of the rendered text against the (ordered) content spans, and one batch
tokenization of the pieces between the template's special tokens. The message count is capped
(`MAX_CHAT_MESSAGES`).
"""

from __future__ import annotations

import copy
import functools
import re
import threading
import uuid
from collections.abc import Sequence

from ..errors import ConfigError

# A conversation longer than this is refused before the template runs. Each message costs a template
# render and a content span; 2,048 turns is far above a real conversation (and, at a few template
# tokens per turn, more than a 2k-token context holds), and encoding that many takes milliseconds.
MAX_CHAT_MESSAGES = 2048


class ChatEncodingError(ConfigError):
    """Messages the encoder refuses; `param` names the request field (the server answers 400)."""

    param = "messages"


class EncodingCancelled(Exception):
    """The caller's cancel event was set (the client went away); the encoding stopped."""


class ChatEncoder:
    """Token ids for a conversation through `tokenizer`'s chat template.

    Args:
        tokenizer: the checkpoint's (fast) tokenizer, with a chat template.
        max_messages: longer conversations raise `ChatEncodingError`.
    """

    def __init__(self, tokenizer, *, max_messages: int = MAX_CHAT_MESSAGES):
        self.tokenizer = tokenizer
        self.max_messages = max_messages
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

    def check_messages(self, messages) -> list[dict]:
        """`messages` as a list of `{"role", "content", ...}` dicts with string contents (None: ""),
        within the cap; the one-line `ChatEncodingError` otherwise."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise ChatEncodingError("messages must be a non-empty list of {'role', 'content'} dicts")
        if len(messages) > self.max_messages:
            raise ChatEncodingError(
                f"the conversation has {len(messages)} messages; at most {self.max_messages} are allowed"
            )
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatEncodingError(f"messages[{i}] must be a dict with a string 'role'")
            content = m.get("content")
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ChatEncodingError(f"messages[{i}].content must be a string")
            out.append({**m, "content": content})
        return out

    def encode(self, messages, *, cancel: threading.Event | None = None) -> list[int]:
        """`[{"role", "content"}]` -> token ids of the prompt (with the generation prompt).

        `cancel`: checked between the steps; once set, `EncodingCancelled` is raised.

        Raises:
            ChatEncodingError: no chat template, too many messages, malformed messages, a template
                that refuses them, or special-token text in a message under a template that changes
                message text (so it cannot be kept apart).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatEncodingError("this model has no chat template")
        messages = self.check_messages(messages)
        _check(cancel)
        text = self.render(messages)
        specials = self._special_re
        whole = specials is not None and any(specials.search(m["content"]) for m in messages)
        spans = None
        if whole or any(self._may_join(m["content"]) for m in messages):
            spans = self._content_spans(messages, text)
            if spans is None and whole:
                raise ChatEncodingError(
                    "a message contains the text of one of this model's special tokens, and its chat"
                    " template changes message text, so it cannot be kept apart: remove the special token"
                )
        _check(cancel)
        if spans is None:  # no special token can come from a message's text
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._encode_with_text_spans(text, spans, cancel)

    @functools.cached_property
    def _fragments(self) -> tuple[frozenset[str], frozenset[str], frozenset[str], int]:
        """Parts of special tokens that a message's text could complete with the template's text
        around it: (tails `S[i:]`, heads `S[:j]`, inner parts `S[i:j]`, the longest token's length)."""
        tails = {s[i:] for s in self.specials for i in range(1, len(s))}
        heads = {s[:j] for s in self.specials for j in range(1, len(s))}
        inner = {s[i:j] for s in self.specials for i in range(1, len(s)) for j in range(i + 1, len(s))}
        return (
            frozenset(tails),
            frozenset(heads),
            frozenset(inner | tails | heads),
            max(map(len, self.specials)),
        )

    def _may_join(self, content: str) -> bool:
        """Whether `content` could be part of a special token that starts or ends outside it: it starts
        with a token's tail, ends with a token's head, or is inside one. O(longest token) lookups."""
        if not content or not self.specials:
            return False
        tails, heads, inner, longest = self._fragments
        reach = min(len(content), longest - 1)
        if any(content[:k] in tails for k in range(1, reach + 1)):
            return True
        return any(content[-k:] in heads for k in range(1, reach + 1)) or content in inner

    def render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. roles must alternate)
            raise ChatEncodingError(f"the chat template refused these messages: {e}") from None

    def _content_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
        """Where each non-empty message content sits in the rendered `text`, in order: render once
        more with unguessable markers as contents, and accept only if putting the contents back gives
        `text` exactly (None: the template changes message text)."""
        nonce = uuid.uuid4().hex
        marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
        marked = self.render([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)])
        pieces = re.split(f"\x00{nonce}:(\\d+)\x00", marked)
        rebuilt, spans, end = [pieces[0]], [], len(pieces[0])
        for index, after in zip(pieces[1::2], pieces[2::2], strict=True):
            content = messages[int(index)]["content"]
            if content:
                spans.append((end, end + len(content)))
            rebuilt += (content, after)
            end += len(content) + len(after)
        return spans if "".join(rebuilt) == text else None

    def _encode_with_text_spans(
        self, text: str, spans: list[tuple[int, int]], cancel: threading.Event | None
    ) -> list[int]:
        """Special tokens count only outside `spans` (ordered, disjoint); everything between them is
        tokenized as text, all pieces in one batch. One pass over the matches and the spans."""
        pieces: list[str | int] = []  # text to tokenize, or a special token's id
        start, j = 0, 0
        for match in self._special_re.finditer(text):
            while j < len(spans) and spans[j][1] <= match.start():
                j += 1  # spans that end before this match can overlap no later match either
            if j < len(spans) and spans[j][0] < match.end():
                continue  # inside (or across the edge of) a message's content: plain text
            if match.start() > start:
                pieces.append(text[start : match.start()])
            pieces.append(self.specials[match.group()])
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
        texts = [p for p in pieces if isinstance(p, str)]
        _check(cancel)
        encoded = iter(self.text_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                ids += next(encoded)
            else:
                ids.append(piece)
        return ids


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise EncodingCancelled()
