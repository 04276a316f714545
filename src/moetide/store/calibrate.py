"""Activation statistics for the calibrated formats (`FormatSpec.calibration`, e.g. "int2+2-gptq").

GPTQ needs, per expert and projection, the second moment of that projection's inputs: for gate_up
the MoE block's input x (H) over the tokens routed to the expert, for down the expert's own
SwiGLU activations h = silu(x W_g^T) * (x W_u^T) (I), each summed as x x^T. They come from one
forward of the checkpoint (transformers, float32, on the CPU or the given device) over calibration
conversations: the first CALIB_CONVERSATIONS ShareGPT V3 conversations outside the demo model's
held-out split (`data.sharegpt.heldout_ids`), chat-templated with the checkpoint's tokenizer, first
CALIB_MAX_LEN tokens. Never the held-out conversations the evaluation measures.

Result: (gate_up (L*E, H, H), down (L*E, I, I)) float32, in the store's expert order, cached next to
the prepared versions as `calib-<key>.safetensors` (the key hashes the checkpoint and the settings
below), so every calibrated format of a checkpoint reuses one pass.

Memory: L*E*(H^2 + I^2) floats (84 MiB for the demo model); the statistics of a large model
(OLMoE-1B-7B: 21 GiB) do not fit this simple scheme, so calibrated formats are for models whose
statistics fit in host memory.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError

CALIB_CONVERSATIONS = 64
CALIB_MAX_LEN = 512
CALIB_BATCH = 8
CALIB_READ_BYTES = 16 << 20  # a prefix of the ShareGPT file holds far more than enough conversations
CALIB_VERSION = 1


def calibration_settings() -> str:
    return f"sharegpt-train:{CALIB_CONVERSATIONS}:{CALIB_MAX_LEN}:v{CALIB_VERSION}"


def calibration_conversations(count: int | None = None) -> list[dict]:
    """The first `count` (default CALIB_CONVERSATIONS) ShareGPT V3 conversations that are not held
    out (file order)."""
    count = CALIB_CONVERSATIONS if count is None else count
    from ..data.sharegpt import conversation_turns, heldout_ids, iter_complete_records, sharegpt_json_path

    held = set(heldout_ids())
    with open(sharegpt_json_path(), encoding="utf-8", errors="replace") as f:
        text = f.read(CALIB_READ_BYTES)
    out = []
    for record in iter_complete_records(text):
        cid = record.get("id")
        turns = conversation_turns(record)
        if not isinstance(cid, str) or cid in held or not turns:
            continue
        out.append({"id": cid, "turns": [list(t) for t in turns]})
        if len(out) == count:
            break
    return out


def calibration_tokens(checkpoint: Path) -> list[list[int]]:
    """Token ids of the calibration conversations, with the checkpoint's tokenizer and chat template."""
    from transformers import AutoTokenizer

    from ..data.sharegpt import encode_conversation

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    except Exception as e:
        raise ConfigError(f"a calibrated format needs the checkpoint's tokenizer: {e}") from None
    return [encode_conversation(tokenizer, c, CALIB_MAX_LEN) for c in calibration_conversations()]


def _experts_modules(model) -> list:
    found = [
        m
        for m in model.modules()
        if hasattr(m, "down_proj") and isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
    ]
    if not found:
        raise ConfigError("calibration needs a transformers MoE with fused experts (gate_up_proj, down_proj)")
    return found


def collect_hessians(
    checkpoint: Path, sequences: list[list[int]], device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert input second moments over `sequences`: (L*E, H, H) and (L*E, I, I) float32."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    if device is not None:
        model = model.to(device)
    modules = _experts_modules(model)
    sums: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook_for(index: int):
        def hook(module, args):
            x, top_k_index = args[0], args[1]
            gate_up, down = sums[index]
            for e in torch.unique(top_k_index).tolist():
                tokens = (top_k_index == e).any(-1).nonzero().squeeze(-1)
                xs = x[tokens].float()
                gate, up = F.linear(xs, module.gate_up_proj[e]).chunk(2, dim=-1)
                h = F.silu(gate) * up
                gate_up[e].addmm_(xs.T, xs)
                down[e].addmm_(h.T, h)

        return hook

    handles = []
    for i, m in enumerate(modules):
        experts, two_i, hidden = m.gate_up_proj.shape
        dev = m.gate_up_proj.device
        sums.append(
            (
                torch.zeros(experts, hidden, hidden, device=dev),
                torch.zeros(experts, two_i // 2, two_i // 2, device=dev),
            )
        )
        handles.append(m.register_forward_pre_hook(hook_for(i)))
    try:
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        with torch.no_grad():
            for b in range(0, len(order), CALIB_BATCH):
                idx = [i for i in order[b : b + CALIB_BATCH] if sequences[i]]
                if not idx:
                    continue
                t = max(len(sequences[i]) for i in idx)
                ids = torch.zeros((len(idx), t), dtype=torch.long)
                mask = torch.zeros((len(idx), t), dtype=torch.long)
                for r, i in enumerate(idx):
                    ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
                    mask[r, : len(sequences[i])] = 1
                # padded positions also reach the experts; their inputs are a small share, kept simple
                model(ids.to(model.device), attention_mask=mask.to(model.device))
    finally:
        for h in handles:
            h.remove()
    gate_up = torch.cat([g for g, _ in sums]).cpu()
    down = torch.cat([d for _, d in sums]).cpu()
    return gate_up, down


def calibration_file(checkpoint: Path, cache_dir: Path) -> Path:
    h = hashlib.sha256()
    for shard in sorted(checkpoint.glob("*.safetensors")):
        st = shard.stat()
        h.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(calibration_settings().encode())
    return cache_dir / f"calib-{h.hexdigest()[:20]}.safetensors"


def expert_hessians(
    checkpoint: Path, cache_dir: Path, num_experts_total: int, device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached statistics of `checkpoint`, computed (and cached) on first use."""
    from .checked_file import DamagedFileError, load_checked, save_checked

    path = calibration_file(checkpoint, cache_dir)
    if path.is_file():
        try:
            t, _ = load_checked(path)
            if set(t) == {"gate_up", "down"} and t["gate_up"].shape[0] == num_experts_total:
                return t["gate_up"], t["down"]
        except DamagedFileError:
            pass  # recomputed below, and written again
    start = time.perf_counter()
    gate_up, down = collect_hessians(checkpoint, calibration_tokens(checkpoint), device)
    if gate_up.shape[0] != num_experts_total:
        raise CheckpointError(
            f"calibration found {gate_up.shape[0]} experts, the store holds {num_experts_total}"
        )
    import sys

    print(
        f"calibration: {CALIB_CONVERSATIONS} training conversations in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        save_checked({"gate_up": gate_up.contiguous(), "down": down.contiguous()}, path)
    except OSError:
        pass
    return gate_up, down
