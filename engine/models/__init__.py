"""Model implementations, chosen by ModelConfig.architecture."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import CausalLM, LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def model_class_for(config: ModelConfig) -> type[CausalLM]:
    """The CausalLM subclass that implements `config.architecture`."""
    return MODEL_CLASSES[config.architecture]


__all__ = [
    "CausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MODEL_CLASSES",
    "model_class_for",
]
