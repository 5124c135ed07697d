"""draftwise: lossless speculative decoding for LLMs."""

from draftwise.engine.outputs import RequestOutput
from draftwise.errors import DraftwiseError
from draftwise.llm import LLM
from draftwise.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "DraftwiseError"]
__version__ = "0.1.0"
