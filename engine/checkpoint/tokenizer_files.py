"""A tokenizer directory read by transformers, without AutoTokenizer where AutoTokenizer would pick the generic fast
tokenizer anyway: its first use imports transformers' whole model registry and the model's configuration module,
about 7 s of a replica's start on the 2-core AVX2 EPYC (docs/OPERATIONS.md,
"Failures and recovery"), against about 1.5 s for the generic class alone.

AutoTokenizer takes the class tokenizer_config.json names, except for model types it knows better (it gives a
Qwen2 checkpoint Qwen2Tokenizer whatever the file says): so the shortcut is taken only for a generic class name
and a model type where AutoTokenizer keeps it (GENERIC_MODEL_TYPES: Llama 3's checkpoints, shardserve's Llama
models; or no config.json, as in the GGUF cache's tokenizer folder). Everything else goes through AutoTokenizer.
tests/engine/test_loader.py checks both give the same tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

# tokenizer_config.json's tokenizer_class values that AutoTokenizer maps to transformers' generic fast tokenizer
# (TokenizersBackend in transformers 5, PreTrainedTokenizerFast before): Llama 3's, shardserve's random models',
# and the GGUF cache's
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# config.json model types for which AutoTokenizer keeps a generic class name as it is
GENERIC_MODEL_TYPES = frozenset({"llama"})


def generic_fast_tokenizer_class():
    """transformers' generic fast tokenizer class, imported from its own module."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend
    except ImportError:  # transformers 4
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast


def autotokenizer_would_pick_the_generic_class(path: Path) -> bool:
    """Whether the directory has a tokenizer.json, its tokenizer_config.json names the generic class, and its model
    type (if it has a config.json) is one AutoTokenizer leaves that to."""
    tokenizer_config, model_config = path / "tokenizer_config.json", path / "config.json"
    if not (path / "tokenizer.json").is_file() or not tokenizer_config.is_file():
        return False
    try:
        if json.loads(tokenizer_config.read_text()).get("tokenizer_class") not in GENERIC_FAST_CLASSES:
            return False
        return not model_config.exists() or json.loads(model_config.read_text()).get("model_type") in GENERIC_MODEL_TYPES
    except (OSError, ValueError):
        return False


def pretrained_tokenizer(path: str | Path):
    """The tokenizer of a local directory, as AutoTokenizer.from_pretrained(path, local_files_only=True) reads it."""
    path = Path(path)
    if autotokenizer_would_pick_the_generic_class(path):
        return generic_fast_tokenizer_class().from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
