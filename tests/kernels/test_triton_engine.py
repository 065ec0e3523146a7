"""The engine on the Triton kernels (in the interpreter) generates what transformers generates."""

import random

import pytest

from engine import LLM, SamplingParams


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.mark.slow
def test_triton_backend_greedy_matches_transformers_with_chunked_prefill(tiny_llama_dir, hf_greedy):
    # Under a 16-token budget the 37-token prompt is prefilled in chunks while the short one decodes;
    # the last chunk starts mid-block.
    prompts = random_prompts([9, 37], seed=4)
    expected = hf_greedy(tiny_llama_dir, prompts, 5, ignore_eos=True)
    assert all(len(set(tokens)) >= 3 for tokens in expected), f"degenerate oracle output: {expected}"

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kernel_backend="triton", max_num_batched_tokens=16)
    assert llm.engine.executor.runner.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))

    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert len(outputs[1].metrics.prefill_chunks) >= 3
