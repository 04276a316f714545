"""CPU tests for the demo model's data: tolerant ShareGPT parsing, held-out split, workload classifier,
shipped held-out set, chat template / end-of-turn token, and the held-out loss helper."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moetide.data import sharegpt as sg

DEMO_DIR = Path(sg.__file__).resolve().parents[1] / "demo_model"


def _record(i, turns):
    return {"id": f"conv{i}_0", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_parse_truncated_json(tmp_path):
    recs = [
        _record(1, [("human", "hi"), ("gpt", "hello")]),
        _record(2, [("system", "be nice"), ("human", "x"), ("gpt", "  "), ("bing", "y"), ("gpt", "z")]),
        _record(3, [("gpt", "")]),  # nothing left after filtering: dropped
        _record(4, [("human", "cut"), ("gpt", "off here {not closed")]),
    ]
    text = json.dumps(recs, indent=2)
    cut = text.index("off here") + 4  # cut the last record in the middle of a string
    p = tmp_path / "sharegpt.json"
    p.write_text(text[:cut])
    convs, counts = sg.load_sharegpt(p)
    assert counts["complete_records"] == 3
    assert [c["id"] for c in convs] == ["conv1_0", "conv2_0"]
    assert convs[0]["turns"] == [["user", "hi"], ["assistant", "hello"]]
    # system / unknown roles and empty turns are dropped
    assert convs[1]["turns"] == [["user", "x"], ["assistant", "z"]]
    # a complete file parses fully, and so does one cut right after a comma
    p.write_text(text)
    assert sg.load_sharegpt(p)[1]["complete_records"] == 4
    p.write_text(text[: text.rindex("},", 0, text.index("conv4")) + 2])
    assert sg.load_sharegpt(p)[1]["complete_records"] == 3


def test_iter_complete_records_edge_cases():
    assert list(sg.iter_complete_records("")) == []
    assert list(sg.iter_complete_records("[")) == []
    assert list(sg.iter_complete_records('[{"a": 1}, {"b"')) == [{"a": 1}]
    assert list(sg.iter_complete_records('[{"a": 1} , {"b": 2}]')) == [{"a": 1}, {"b": 2}]


def test_split_is_deterministic_and_by_base_id():
    assert sg.base_id("QWJhYvA_12") == "QWJhYvA"
    assert sg.base_id("abc") == "abc"
    assert sg.base_id("a_b_c") == "a_b_c"
    assert sg.split_score("X_0") == sg.split_score("X_1") == sg.split_score("X")
    ids = [f"id{i}_{j}" for i in range(2000) for j in range(2)]
    a = [sg.is_heldout(i) for i in ids]
    assert a == [sg.is_heldout(i) for i in ids]
    # parts of one conversation are on the same side
    assert all(a[2 * k] == a[2 * k + 1] for k in range(2000))
    share = sum(a) / len(a)
    assert 0.01 < share < 0.045
    # non-English bases are held out at a higher rate
    assert sum(sg.is_heldout(i, "non-english") for i in ids) / len(ids) > 0.4
    convs = [{"id": i, "turns": [["user", "hello there, how are you"]]} for i in ids]
    train, held = sg.split_conversations(convs)
    assert len(train) + len(held) == len(convs)
    assert {c["id"] for c in held} == {i for i, h in zip(ids, a) if h}


def test_classify_workload():
    assert sg.classify_workload("Here is the code:\n```python\nprint(1)\n```") == "code"
    py = "def f(x):\n    return x + 1\n\nimport os\nprint(f(2))\n"
    assert sg.classify_workload([["user", "fix this"], ["assistant", py]]) == "code"
    assert (
        sg.classify_workload(
            {"turns": [["user", "请帮我写一首关于春天的诗"], ["assistant", "春风拂面，花开满园。"]]}
        )
        == "non-english"
    )
    es = (
        "Hola, necesito una receta para la cena. ¿Qué me recomiendas? Algo con pollo y arroz, por favor, "
        "que sea fácil de preparar para una familia de cuatro personas y que no tenga mucha grasa. "
        "Claro, aquí está una receta de arroz con pollo que es fácil de hacer y es muy rica para la familia."
    )
    assert sg.classify_workload(es) == "non-english"
    en = (
        "What are some good ideas for a birthday party for a ten year old? I want it to be fun and not "
        "too expensive. Here are a few ideas: a scavenger hunt, a movie night, or a picnic in the park."
    )
    assert sg.classify_workload([("user", en)]) == "chat"
    assert sg.classify_workload({"conversations": [{"from": "human", "value": en}]}) == "chat"
    assert set(sg.WORKLOADS) == {"code", "non-english", "chat"}


def test_shipped_heldout_set():
    convs = sg.heldout_conversations()
    ids = sg.heldout_ids()
    assert len(convs) >= 300
    assert [c["id"] for c in convs] == ids
    assert len(set(ids)) == len(ids)
    assert {c["workload"] for c in convs} == set(sg.WORKLOADS)
    for c in convs[:50]:
        assert c["turns"] and all(r in ("user", "assistant") and t for r, t in c["turns"])
        assert sg.classify_workload(c) == c["workload"]
    code = sg.heldout_conversations(workload="code")
    assert code and all(c["workload"] == "code" for c in code)


def test_heldout_loss_uniform_model():
    torch = pytest.importorskip("torch")

    class Tok:  # minimal tokenizer: one token per character
        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
            return [ord(ch) % 50 for m in messages for ch in m["content"]]

    V = 50

    def uniform(x, attention_mask=None):
        return torch.zeros(x.shape[0], x.shape[1], V)

    convs = [{"turns": [["user", "abcdef"], ["assistant", "gh"]]}, {"turns": [["user", "xyz" * 300]]}]
    mean, per = sg.heldout_loss(uniform, Tok(), convs, max_len=64, per_conversation=True)
    assert mean == pytest.approx(math.log(V), rel=1e-5)
    assert [n for _, n in per] == [7, 63]  # truncated to max_len, first token not scored
    # batch size 1 (callables without attention_mask) gives the same value
    assert sg.heldout_loss(uniform, Tok(), convs, max_len=64, batch_size=1) == pytest.approx(mean)


@pytest.fixture(scope="module")
def demo_tokenizer():
    if not (DEMO_DIR / "tokenizer.json").exists():
        pytest.skip("demo model tokenizer not built")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(DEMO_DIR)


def test_chat_template_and_end_of_turn(demo_tokenizer):
    tok = demo_tokenizer
    assert len(tok) == 8192
    msgs = [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi. How can I help?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|endoftext|><|user|>\nHello there!<|end|><|assistant|>\nHi. How can I help?<|end|>"
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|assistant|>\n")
    ids = sg.encode_conversation(tok, {"turns": [[m["role"], m["content"]] for m in msgs]})
    eot = tok.convert_tokens_to_ids("<|end|>")
    assert tok.eos_token == "<|end|>" and tok.eos_token_id == eot
    assert ids[0] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert ids.count(eot) == 2 and ids[-1] == eot
    assert ids[1] == tok.convert_tokens_to_ids("<|user|>")
    assert tok.decode(ids) == text  # byte-level: lossless round trip
    # special-token strings are single tokens; arbitrary bytes round-trip
    s = "naïve 東京 🙂 \t code{}"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    gen = DEMO_DIR / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text())["eos_token_id"]
        assert eot in (eos if isinstance(eos, list) else [eos])


def _training_script():
    from script_module import load_script

    return load_script("train_demo_model")


def test_model_card_is_what_the_script_renders_from_the_shipped_training_stats():
    """MODEL.md holds, line for line, what `train_demo_model.py --stage report` renders from the
    shipped `training_stats.json` (the numbers the script prints), and its headline held-out loss is
    the stats' own."""
    demo = Path(__file__).resolve().parents[1] / "src" / "moetide" / "demo_model"
    stats = json.loads((demo / "training_stats.json").read_text())
    card = (demo / "MODEL.md").read_text()
    rendered = _training_script().render_stats(stats)
    assert [line for line in rendered.splitlines() if line not in card] == []
    assert f"**{stats['eval']['heldout_loss']:.4f}**" in card


def test_training_experts_forward_matches_eager_loss_and_gradients():
    """The training script's `grouped_mm_bf16` experts (bf16 grouped GEMMs on fp32 master weights) give
    transformers' eager experts' loss and expert-weight gradients, to bf16 precision."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    train = _training_script()
    train.register_training_experts()
    cfg = train.make_config()
    cfg.num_hidden_layers = 2
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    results = {}
    for impl in ("eager", "grouped_mm_bf16"):
        model.set_experts_implementation(impl)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        experts = model.model.layers[0].mlp.experts
        results[impl] = (loss.item(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())
    (loss_e, gu_e, d_e), (loss_g, gu_g, d_g) = results["eager"], results["grouped_mm_bf16"]
    assert loss_g == pytest.approx(loss_e, abs=2e-3)
    for ref, got in ((gu_e, gu_g), (d_e, d_g)):
        assert ref.abs().max() > 0
        assert (got - ref).abs().max() <= 0.03 * ref.abs().max()
