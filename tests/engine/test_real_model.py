"""The demo model, a real trained checkpoint (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy output equals
transformers loading the same file, batched and under chunked prefill, and it knows its geography; so
does an engine that loads it from its unpacked cache (engine/checkpoint/gguf_cache.py) without reading the
file."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint.demo import unpack_demo_model
from engine.checkpoint.gguf import model_config_fields
from engine.checkpoint.gguf_cache import unpack_gguf, unpacked_dir
from engine.checkpoint.model_config import load_model_config
from engine.config import EngineConfig, ModelConfig
from tests.engine.test_gguf_cache import forbid_reading_the_gguf

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain recursion in one sentence.",
]
MAX_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def gguf_cache_root(smollm2_gguf, tmp_path_factory):
    """The demo model unpacks into a folder of this module's, not the user's cache (the file itself is
    found first, where `make install` put it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def chat_prompts(smollm2_gguf) -> list[list[int]]:
    from engine.checkpoint.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def transformers_greedy(smollm2_gguf, chat_prompts) -> list[list[int]]:
    """transformers' own GGUF loader (dequantized to float32), greedy, one prompt at a time, up to EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    outputs = []
    for prompt in chat_prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
        new = ids[0, len(prompt):].tolist()
        outputs.append(new[: new.index(eos) + 1] if eos in new else new)
    return outputs


def test_the_config_is_read_from_the_gguf_metadata(smollm2_gguf):
    config = load_model_config(smollm2_gguf)
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (49152, 8192, True)
    assert config.eos_token_ids == (2,)  # <|im_end|>: a chat turn ends generation


def test_greedy_chat_answers_equal_transformers_batched_and_chunked(smollm2_gguf, chat_prompts, transformers_greedy):
    assert len({tuple(t) for t in transformers_greedy}) == len(QUESTIONS)
    llm = LLM(model=str(smollm2_gguf), dtype="float32", max_num_batched_tokens=32)  # 37-token prompts: 2 chunks
    try:
        outputs = llm.generate(chat_prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
        assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy
        assert "Paris" in outputs[0].outputs[0].text
        stats = llm.engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()


def test_the_install_step_unpacks_what_auto_dtype_serves(smollm2_gguf):
    folder = unpack_demo_model(smollm2_gguf)
    config = load_model_config(smollm2_gguf)
    auto = str(EngineConfig(model=str(smollm2_gguf)).torch_dtype(config)).removeprefix("torch.")
    assert folder == unpacked_dir(smollm2_gguf)
    assert {"model_config.json", "tokenizer", f"weights-{auto}"} <= {p.name for p in folder.iterdir()}
    assert config == ModelConfig(**model_config_fields(smollm2_gguf))


def test_greedy_chat_answers_from_the_unpacked_cache_equal_transformers(smollm2_gguf, chat_prompts,
                                                                        transformers_greedy, monkeypatch):
    unpack_gguf(smollm2_gguf, torch.float32)  # already there when the test above ran first
    forbid_reading_the_gguf(monkeypatch)
    llm = LLM(model=str(smollm2_gguf), dtype="float32")
    try:
        outputs = llm.generate(chat_prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
        assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy
    finally:
        llm.shutdown()
