"""Streaming text out of a growing token sequence without printing half characters, and the stop
strings that cut it.

The engine re-decodes a sequence's whole output after every token (`Sequence.text`). A character
that takes several byte-level tokens (Chinese, Cyrillic, accented Latin, emoji) decodes to U+FFFD
until its last byte arrives, so the tail of the text can still change; a stop string that has only
begun can still cut it. Only the stable prefix is ever shown, which is what the server's SSE stream
and `moetide generate` both do.

Stop strings are searched for only where a new one can be: in the text after the previous token's
stable prefix, less the longest stop string's length. A request's stop list is capped
(`MAX_STOP_STRINGS` strings of at most `MAX_STOP_STRING_CHARS` characters), so the work per token is
at most that many searches over a tail of about that many characters, whatever the request.
"""

from __future__ import annotations

from ..errors import ConfigError

REPLACEMENT_CHAR = "\ufffd"
# OpenAI allows 4 stop strings. 16 of 256 characters keep every search per token within a tail of
# ~256 characters plus the new token's text (16 searches of a few hundred characters: microseconds),
# and hold back at most 255 characters of a stream.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def stop_strings(stop) -> tuple[str, ...]:
    """A request's `stop` (None, a string, or a list of strings) as a tuple, checked against the caps.

    Raises:
        ConfigError: an empty or non-string entry, more than MAX_STOP_STRINGS strings, or one longer
            than MAX_STOP_STRING_CHARS characters.
    """
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise ConfigError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not isinstance(s, str) or not s for s in stops):
        raise ConfigError("stop must be a non-empty string or a list of non-empty strings")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise ConfigError(
            f"a stop string has {len(longest)} characters; at most {MAX_STOP_STRING_CHARS} are allowed"
        )
    return stops


def find_stop(text: str, previous: str, stop: tuple[str, ...]) -> int:
    """Where the first stop string starts in `text`, the decoded output after a new token, or -1.

    `previous` is the text before that token, already searched: a match that ended inside its stable
    prefix was found then, so only the tail from that prefix's end, less the longest stop string
    (minus one character), is searched. Where the new text does not extend that prefix (a tokenizer
    whose decoding changes earlier characters), the whole text is searched.
    """
    if not stop:
        return -1
    seen = stable_prefix(previous)
    start = max(0, len(seen) - max(len(s) for s in stop) + 1) if text.startswith(seen) else 0
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found, default=-1)


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
    printed, or, once the sequence is finished, everything left (the engine drops a character that
    `max_tokens` cut half-way; a U+FFFD still there at the end is one the model ended its turn in).
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
