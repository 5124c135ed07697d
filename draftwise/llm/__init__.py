"""The API users hold: `LLM(model=..., speculative=...)` with `generate`, `chat`, `stream` and the step
API the server drives. It sits on the engine and builds drafters through the registry."""

from draftwise.llm.llm import LLM, StreamDelta

__all__ = ["LLM", "StreamDelta"]
