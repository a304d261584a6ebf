"""kestrel: a serving stack for the Kimi K3 model family (Kimi K3.1 Pro, Kimi K3, Kimi-Linear-48B-A3B)."""

from .engine.llm import LLM
from .engine.outputs import CompletionOutput, Logprob, RequestOutput
from .engine.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
