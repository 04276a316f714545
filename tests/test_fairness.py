"""One hostile client must not slow everyone: 8 normal streams beside one adversarial request, per
kind of bound the server keeps, on the demo model (a real server on loopback, the `openai` client).

The normal streams' median TPOT with the adversarial ninth request is compared with a control run of
the same server in the same test, whose ninth request is benign and of the same shape
(scripts/bench_adversarial.py builds both and says what each is). Two timings of one run, so the
ratio means the same on a slow or busy machine; a second pair is run only when the first is over the
goal (a shared machine's hiccup). Before the bounds these gave 2-5x (stop list), 1.4-2.8x (special
tokens in chat) and 1.2-2.8x (message count) on the 2-core CPU machine; now about 1.
"""

from __future__ import annotations

import pytest
from live_server import start_server
from script_module import load_script

from moetide.engine.llm import demo_model_path

bench = load_script("bench_adversarial")
MODEL = "moetide-demo"
TOKENS = 64  # per normal stream: ~2 s per run on the CPU


@pytest.fixture(scope="module")
def demo_server():
    live = start_server(demo_model_path(), max_num_seqs=16, max_queue=64, model_name=MODEL)
    yield live
    live.close()


def _assert_fair(result: dict) -> None:
    last = result["pairs"][-1]
    assert result["ratio"] <= bench.GOAL, (
        f"{result['kind']}: normal TPOT {last['adversarial_median_tpot_s'] * 1e3:.1f} ms beside the"
        f" adversarial request, {last['control_median_tpot_s'] * 1e3:.1f} ms beside the benign one"
        f" (ratios {[round(p['ratio'], 2) for p in result['pairs']]})"
    )


def test_a_huge_stop_list_does_not_slow_the_other_streams(demo_server):
    result = bench.measure_kind(demo_server.base_url, MODEL, "stop_list", tokens=TOKENS, attempts=2)
    _assert_fair(result)
    # refused by the cap, then the largest list allowed streamed beside the others
    assert result["pairs"][-1]["adversarial"]["ninth_status"] == [400, 200]


def test_special_token_text_in_many_messages_does_not_slow_the_other_streams(demo_server):
    result = bench.measure_kind(demo_server.base_url, MODEL, "special_chat", tokens=TOKENS, attempts=2)
    _assert_fair(result)
    assert result["pairs"][-1]["adversarial"]["ninth_status"] == [400]  # encoded: longer than the context


def test_a_conversation_over_the_message_cap_does_not_slow_the_other_streams(demo_server):
    result = bench.measure_kind(demo_server.base_url, MODEL, "message_count", tokens=TOKENS, attempts=2)
    _assert_fair(result)
    assert result["pairs"][-1]["adversarial"]["ninth_status"] == [400]
