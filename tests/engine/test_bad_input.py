"""Bad input raises a specific exception naming the limit, and leaves other requests untouched."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from engine.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)


def greedy(**kw):
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_prompt_plus_max_tokens_over_max_model_len_names_both_numbers(llm):
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 128 tokens.*130 tokens \(100 in the prompt, 30"):
        llm.generate([[5] * 100], greedy(max_tokens=30))


def test_max_tokens_left_out_means_the_rest_of_the_context(llm):
    out = llm.generate([[5] * 120], greedy(max_tokens=None))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_a_prompt_that_fills_the_context_is_refused_when_max_tokens_is_left_out(llm):
    with pytest.raises(InvalidRequestError, match="maximum context length is 128 tokens. However, your prompt has 128"):
        llm.generate([[5] * 128], greedy(max_tokens=None))


def test_empty_prompt_is_rejected(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], greedy(max_tokens=4))


def test_token_id_outside_vocabulary_is_rejected(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"token id 99999 is outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[5, 99999]], greedy(max_tokens=4))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("temperature", -1.0, "temperature must be non-negative"),
        ("top_k", 0, "top_k must be -1"),
        ("n", 0, "n must be at least 1"),
        ("logprobs", 50, r"logprobs must be in \[0, 20\]"),
    ],
)
def test_bad_sampling_values_name_the_limit(field, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{field: value})


def test_a_rejected_request_leaves_other_requests_untouched(llm):
    engine = llm.engine
    prompt = [7, 8, 9, 10, 11]
    expected = llm.generate([prompt], greedy(max_tokens=6))[0].outputs[0].token_ids
    engine.add_request("good", prompt, greedy(max_tokens=6))
    tokens = [t for delta in engine.step() for t in delta.outputs[0].token_ids]
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [5] * 200, greedy(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", prompt, greedy(max_tokens=6))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.extend(delta.outputs[0].token_ids)
    assert tokens == expected
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_a_batch_with_one_bad_prompt_adds_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], [5] * 200], greedy(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    engine.add_request("to-abort", [3] * 40, greedy(max_tokens=50))
    engine.step()
    assert engine.scheduler.block_manager.num_free_blocks < engine.scheduler.block_manager.num_blocks
    final = engine.abort_request("to-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    engine.scheduler.block_manager.check_invariants()


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_checkpoint_missing_a_tensor_names_it(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    [weights_file] = broken.glob("*.safetensors")
    tensors = load_file(weights_file)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(model=str(broken))


def test_impossible_tensor_parallel_layout_is_rejected_with_the_numbers(tiny_llama_dir, tmp_path):
    odd = tmp_path / "odd-heads"
    shutil.copytree(tiny_llama_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config["num_attention_heads"], config["num_key_value_heads"] = 6, 6
    config["head_dim"] = 64 // 6 or 1
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be divisible by tensor_parallel_size \(4\)"):
        LLM(model=str(odd), tensor_parallel_size=4)


def test_engine_config_validates_its_own_fields():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(model="x", block_size=12)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 2, 4 or 8"):
        EngineConfig(model="x", tensor_parallel_size=3)
