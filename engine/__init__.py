"""shardserve's engine: one replica's scheduler, KV cache and model runner."""

from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelConfig, SamplingParams
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, ModelLoadError
from engine.outputs import CompletionOutput, EngineStats, RequestOutput

if TYPE_CHECKING:  # the engine classes load lazily (__getattr__ below)
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLM, LLMEngine

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "LLMEngine",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineStats",
    "EngineError",
    "EngineDeadError",
    "InvalidRequestError",
    "ModelLoadError",
]


def __getattr__(name):
    # The engine classes pull in the model code; import them on first use only.
    if name in ("LLM", "LLMEngine"):
        from engine import llm_engine

        return getattr(llm_engine, name)
    if name == "AsyncLLMEngine":
        from engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
