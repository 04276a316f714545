"""moetide: serve Mixture-of-Experts LLMs on a GPU smaller than the model.

FineMoE-style fine-grained expert prefetch + DynaExq-style dynamic expert precision, on top of
transformers' own modeling code (only the experts module is replaced).
"""

from .engine.llm import LLM, RequestOutput, demo_model_path
from .engine.sampling import SamplingParams
from .errors import MoetideError

__all__ = ["LLM", "MoetideError", "RequestOutput", "SamplingParams", "demo_model_path"]
__version__ = "0.1.0"
