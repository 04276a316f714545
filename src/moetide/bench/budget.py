"""Relative memory budgets (`25%` = the fixed part + 25 % of all experts in hi precision).

They are resolved by `engine.memory`, which every command that takes `--gpu-memory` uses; the names
stay importable from here for the benchmark and eval harnesses.
"""

from __future__ import annotations

from ..engine.memory import ModelBytes, model_bytes, resolve_budget

__all__ = ["ModelBytes", "model_bytes", "resolve_budget"]
