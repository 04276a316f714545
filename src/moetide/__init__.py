"""moetide: serve Mixture-of-Experts LLMs on a GPU smaller than the model.

FineMoE-style fine-grained expert prefetch + DynaExq-style dynamic expert precision, on top of
transformers' own modeling code (only the experts module is replaced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import MoetideError

if TYPE_CHECKING:
    from .engine.llm import LLM, RequestOutput, demo_model_path
    from .engine.sampling import SamplingParams

__all__ = ["LLM", "MoetideError", "RequestOutput", "SamplingParams", "demo_model_path"]
__version__ = "0.1.0"

# The engine (transformers, torch's compiler) is imported on first use of these names, not with the
# package: a process that needs one subpackage, such as the FineMoE searcher child (moetide.policies),
# starts without it.
def __getattr__(name: str):
    if name == "SamplingParams":
        from .engine import sampling as module
    elif name in ("LLM", "RequestOutput", "demo_model_path"):
        from .engine import llm as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
