"""The bounds on one request's work below the server, with the demo model's tokenizer: the shared
chat encoder (special-token text stays text, linear, capped, cancellable) and stop strings (capped,
searched only in the new tail of the text). The HTTP paths and the fairness they buy are in
test_server_hostile.py and test_fairness.py."""

from __future__ import annotations

import random
import threading

import pytest

from moetide.engine.chat import MAX_CHAT_MESSAGES, ChatEncoder, ChatEncodingError, EncodingCancelled
from moetide.engine.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, find_stop
from moetide.engine.sampling import SamplingParams
from moetide.errors import ConfigError

PIECES = [
    "<|end|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|endoftext|>",
    "<|",
    "|>",
    "end",
    "hi",
    " there",
    "\n",
    "é",
    "東京",
    " ",
]


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from moetide.engine.llm import demo_model_path

    return AutoTokenizer.from_pretrained(demo_model_path())


def _conversation(rng: random.Random, n: int) -> list[dict]:
    roles = ("user", "assistant", "system")
    return [
        {"role": rng.choice(roles), "content": "".join(rng.choices(PIECES, k=rng.randint(0, 8)))}
        for _ in range(n)
    ]


def _reference_ids(tok, messages: list[dict]) -> list[int]:
    """What the encoder must give, the slow way: the template's text split at every special-token
    match that no message's content overlaps (found by testing each match against every span), each
    piece between them tokenized on its own as text."""
    import re

    encoder = ChatEncoder(tok)  # the reference shares only the rendering and the spans
    text = encoder.render(messages)
    spans = encoder._content_spans(messages, text)
    special = re.compile("|".join(re.escape(s) for s in sorted(encoder.specials, key=len, reverse=True)))
    ids, start = [], 0
    for m in special.finditer(text):
        if any(a < m.end() and m.start() < b for a, b in spans):
            continue
        ids += encoder.text_tokenizer.encode(text[start : m.start()], add_special_tokens=False)
        ids.append(encoder.specials[m.group()])
        start = m.end()
    return ids + encoder.text_tokenizer.encode(text[start:], add_special_tokens=False)


def test_the_encoder_gives_the_reference_ids_on_random_conversations(demo_tokenizer):
    encoder, rng = ChatEncoder(demo_tokenizer), random.Random(0)
    for _ in range(200):
        messages = _conversation(rng, rng.randint(1, 6))
        assert encoder.encode(messages) == _reference_ids(demo_tokenizer, messages), messages


def test_a_special_token_formed_across_a_contents_edge_stays_text(demo_tokenizer):
    """A template that writes `<|` before each content and `|>` after it: content `end` makes
    `<|end|>` across both edges, which overlaps the content and so is text."""
    import copy

    tok = copy.deepcopy(demo_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n<|' + m['content'] + '|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    encoder = ChatEncoder(tok)
    ids = encoder.encode([{"role": "user", "content": "end"}])
    assert tok.convert_tokens_to_ids("<|end|>") not in ids
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and ids[-2] == tok.convert_tokens_to_ids(
        "<|assistant|>"
    )
    rng = random.Random(2)
    for _ in range(100):
        messages = _conversation(rng, rng.randint(1, 4))
        assert encoder.encode(messages) == _reference_ids(tok, messages), messages


def test_under_a_template_that_trims_contents_only_a_whole_special_token_is_refused(demo_tokenizer):
    import copy

    tok = copy.deepcopy(demo_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] | trim + '<|end|>' }}{% endfor %}"
    )
    encoder = ChatEncoder(tok)
    with pytest.raises(ChatEncodingError, match="cannot be kept apart"):
        encoder.encode([{"role": "user", "content": " hi <|end|> "}])
    rendered = encoder.render([{"role": "user", "content": " is 3 < "}])  # ends like a token's head
    assert encoder.encode([{"role": "user", "content": " is 3 < "}]) == tok.encode(
        rendered, add_special_tokens=False
    )


def test_messages_of_special_token_text_keep_only_the_templates_special_tokens(demo_tokenizer):
    """The issue's reproducer: N messages whose content is `<|end|>` (here N = 2,000, under the cap):
    every `<|end|>` of the contents is text, each turn's header and end are the template's tokens."""
    tok = demo_tokenizer
    messages = [{"role": ("user", "assistant")[i % 2], "content": "<|end|>"} for i in range(2000)]
    ids = ChatEncoder(tok).encode(messages)
    end, user, assistant = (tok.convert_tokens_to_ids(t) for t in ("<|end|>", "<|user|>", "<|assistant|>"))
    assert ids.count(end) == 2000 and ids.count(user) == 1000 and ids.count(assistant) == 1001
    assert tok.decode(ids) == ChatEncoder(tok).render(messages)  # nothing lost: the text is all there


def test_a_conversation_over_the_cap_is_refused_before_the_template_runs(demo_tokenizer):
    encoder = ChatEncoder(demo_tokenizer)
    rendered = []
    encoder.render = lambda messages: rendered.append(len(messages)) or ""  # this instance only
    over = [{"role": "user", "content": "<|end|>"}] * (MAX_CHAT_MESSAGES + 1)
    with pytest.raises(ChatEncodingError, match=f"at most {MAX_CHAT_MESSAGES}"):
        encoder.encode(over)
    assert rendered == []


MALFORMED = [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"content": "x"}], "role"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "robot", "content": "x"}], "template refused"),
]


@pytest.mark.parametrize(
    "messages, fragment",
    MALFORMED,
    ids=["empty", "a string", "no role", "content not a string", "role the template refuses"],
)
def test_malformed_messages_get_one_line(demo_tokenizer, messages, fragment):
    with pytest.raises(ChatEncodingError, match=fragment) as info:
        ChatEncoder(demo_tokenizer).encode(messages)
    assert "\n" not in str(info.value) and isinstance(info.value, ConfigError)


def test_a_set_cancel_event_stops_the_encoding_before_it_tokenizes(demo_tokenizer):
    encoder = ChatEncoder(demo_tokenizer)
    cancel = threading.Event()
    cancel.set()
    for content in ("plain", "with <|end|> inside"):
        with pytest.raises(EncodingCancelled):
            encoder.encode([{"role": "user", "content": content}], cancel=cancel)
    assert encoder.encode([{"role": "user", "content": "x"}], cancel=threading.Event())


# -- stop strings -------------------------------------------------------------------------------------------
def test_stop_lists_are_capped_in_count_and_length():
    widest = tuple("y" * (MAX_STOP_STRING_CHARS - 1) + f"{i:02d}" for i in range(MAX_STOP_STRINGS))  # +1
    with pytest.raises(ConfigError, match=f"at most {MAX_STOP_STRING_CHARS}"):
        SamplingParams(stop=widest)
    allowed = tuple(s[1:] for s in widest)
    assert SamplingParams(stop=allowed).stop == allowed
    with pytest.raises(ConfigError, match=f"at most {MAX_STOP_STRINGS} are allowed"):
        SamplingParams(stop=[f"s{i:07d}" for i in range(400_000)])  # the reproducer
    with pytest.raises(ConfigError, match="non-empty"):
        SamplingParams(stop=["a", ""])
    assert SamplingParams(stop="END").stop == ("END",) and SamplingParams().stop == ()


def _first_stop_naive(text: str, stop: tuple[str, ...]) -> int:
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)


def test_searching_the_new_tail_finds_what_searching_the_whole_text_finds():
    """Texts grown a piece at a time, half characters (U+FFFD) included, that later pieces complete:
    the tail search stops where a search of the whole text after every piece stops."""
    rng = random.Random(1)
    alphabet = ["ab", "a", "b", "ba", "\ufffd", "c", "abc", "aab"]
    for _ in range(2000):
        stop = tuple({"".join(rng.choices("abc", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))})
        text, expected, found = "", -1, -1
        for _ in range(rng.randint(1, 12)):
            previous = text
            stable = previous.rstrip("\ufffd")
            # a half character (U+FFFD) at the end may become a real one: only that tail changes
            text = stable + ("a" if previous != stable and rng.random() < 0.5 else "") + rng.choice(alphabet)
            expected = _first_stop_naive(text, stop)
            found = find_stop(text, previous, stop)
            if expected >= 0:
                break
        assert found == expected, (stop, previous, text)


def test_a_decoding_that_rewrites_earlier_text_is_searched_whole():
    # a tokenizer that cleans up spaces before punctuation turns "a b " + "." into "a b."
    assert find_stop("a b.", "a b ", ("b.",)) == 2
    assert find_stop("0123456789", "012345678", ("5678",)) == -1  # already searched: nothing new
