"""Streaming text out of a growing token sequence without printing half characters.

The engine re-decodes a sequence's whole output after every token (`Sequence.text`). A character
that takes several byte-level tokens (Chinese, Cyrillic, accented Latin, emoji) decodes to U+FFFD
until its last byte arrives, so the tail of the text can still change; a stop string that has only
begun can still cut it. Only the stable prefix is ever shown, which is what the server's SSE stream
and `moetide generate` both do.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


def stable_prefix(text: str, hold_back_chars: int = 0) -> str:
    """The part of a growing text that later tokens cannot change: no trailing half-decoded
    character (U+FFFD), and not the last `hold_back_chars` characters (a stop string may start there)."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT_CHAR:
        end -= 1
    return text[: max(0, end - hold_back_chars)]


class TextStream:
    """The new, stable text of one sequence after each engine step.

    `delta(text, finished)` returns what to print now: the stable prefix of `text` beyond what was
    printed, or, once the sequence is finished, everything left (a U+FFFD that is still there at the
    end is a byte sequence the model really left incomplete).
    """

    def __init__(self, stop: tuple[str, ...] = ()):
        self.hold_back_chars = max((len(s) for s in stop), default=1) - 1
        self.printed = 0

    def delta(self, text: str, finished: bool) -> str:
        shown = text if finished else stable_prefix(text, self.hold_back_chars)
        if len(shown) <= self.printed:
            return ""
        out = shown[self.printed :]
        self.printed = len(shown)
        return out
