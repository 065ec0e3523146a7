"""Ray once per session for the tensor-parallel tests, and the extra model shapes they need."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from engine.checkpoint.random_model import BOS_ID, EOS_ID, PRESETS, train_tokenizer

# not divisible by 2 or 4: ParallelLMHead pads it to 1022 / 1024 and trims the padding
ODD_VOCAB_SIZE = 1021


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for a test module, unless one is connected already (then it is reused, left up).

    Module scope, not session: a session fixture elsewhere (the Serve cluster, tests/conftest.py's `serve_cluster`) may call
    `ray.init` after these tests, and finds no Ray left running. CPU bundles are logical: 8 CPUs
    hold a TP=4 engine and two TP=2.
    """
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama_odd_vocab_dir(tmp_path_factory) -> Path:
    """The tiny Llama shape with a vocabulary of 1021 tokens (random norms, initializer_range 0.1)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama-odd-vocab")
    shape = {**PRESETS["tiny"], "vocab_size": ODD_VOCAB_SIZE}
    config = LlamaConfig(
        **shape, initializer_range=0.1, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norm weights other than 1, so a misloaded norm changes the output
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(str(out))
    train_tokenizer(ODD_VOCAB_SIZE, 300_000, shape["max_position_embeddings"]).save_pretrained(str(out))
    return out
