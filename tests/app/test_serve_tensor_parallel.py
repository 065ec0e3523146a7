"""TP=2 through Serve on CPU: the replica's 2-bundle placement group hosts rank 0 and one worker actor."""

from __future__ import annotations

import openai
import pytest

from engine import SamplingParams
from tests.app.conftest import SERVED_NAME, tiny_serve_args


@pytest.mark.slow
def test_tp2_replica_serves_the_same_greedy_text(serve_cluster, tiny_llama_dir, offline_llm):
    from ray import serve
    from ray.util import placement_group_table

    from app.deployment import build_app

    args = tiny_serve_args(tiny_llama_dir, tensor_parallel_size=2, api_key=None)
    serve.run(build_app(args), name="tp2", route_prefix="/tp2")
    try:
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED" and len(g["bundles"]) == 2]
        assert [g["strategy"] for g in groups] == ["STRICT_PACK"]
        assert list(groups[0]["bundles"].values()) == [{"CPU": 0.5}, {"CPU": 0.5}]
        prompts = ["The quick brown fox", "Once upon a time"]
        expected = [o.outputs[0].text for o in offline_llm.generate(prompts, SamplingParams(temperature=0,
                                                                                           max_tokens=12))]
        client = openai.OpenAI(base_url=serve_cluster.url("/tp2/v1"), api_key="unused", max_retries=0)
        response = client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=12, temperature=0)
        assert [c.text for c in response.choices] == expected
    finally:
        serve.delete("tp2")
