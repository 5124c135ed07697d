"""draftwise: lossless speculative decoding for LLMs."""

from draftwise.engine.outputs import RequestOutput
from draftwise.errors import DraftwiseError
from draftwise.llm import LLM
from draftwise.llm.requests import TokensPrompt
from draftwise.sampling.params import SamplingParams
from draftwise.sampling.structured_params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput", "TokensPrompt", "DraftwiseError"]
__version__ = "0.1.0"
