"""Data for the embedded demo model: tolerant ShareGPT V3 parsing, the fixed held-out split, workload
classes and the held-out loss. See :mod:`moetide.data.sharegpt`."""

from .sharegpt import (
    HELDOUT_FRACTION,
    WORKLOADS,
    base_id,
    classify_workload,
    conversation_turns,
    encode_conversation,
    heldout_conversations,
    heldout_ids,
    heldout_loss,
    is_heldout,
    iter_complete_records,
    load_sharegpt,
    split_conversations,
    to_messages,
)

__all__ = [
    "HELDOUT_FRACTION",
    "WORKLOADS",
    "base_id",
    "classify_workload",
    "conversation_turns",
    "encode_conversation",
    "heldout_conversations",
    "heldout_ids",
    "heldout_loss",
    "is_heldout",
    "iter_complete_records",
    "load_sharegpt",
    "split_conversations",
    "to_messages",
]
