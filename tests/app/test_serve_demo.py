"""The demo model as `make run` serves it (no --model): a real answer through Serve and the openai client."""

from __future__ import annotations

import openai

from app.config import ServeArgs
from app.deployment import DEMO_MODEL_NAME


def test_the_demo_model_answers_a_chat_question_and_reports_its_context(serve_cluster, smollm2_gguf):
    from ray import serve

    from app.deployment import build_app

    # what `shardserve serve` runs, smaller: one replica on half a CPU, a small batch; in float32 (what `--dtype
    # auto` gives it on a CPU without bfloat16 arithmetic), since in bfloat16 its first token here is a coin toss:
    # "The" leads "L" by 0.08 in float32's logits, and bfloat16 logits of ~15 step by 0.06, so torch's attention
    # and the AMX kernel, equally close to the float64 answer, gave "The capital of France is Paris." and
    # "L'Étoile, la Marseillaise, ..." (2026-12-05, Intel Xeon with AMX)
    args = ServeArgs(num_replicas=1, cpus_per_rank=0.5, max_num_seqs=8, dtype="float32")
    serve.run(build_app(args), name="demo", route_prefix="/demo")
    try:
        client = openai.OpenAI(base_url=serve_cluster.url("/demo/v1"), api_key="unused", max_retries=0)
        [model] = client.models.list().data
        assert (model.id, model.max_model_len) == (DEMO_MODEL_NAME, 8192)
        response = client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in response.choices[0].message.content
        assert response.choices[0].finish_reason == "stop"  # the turn ends with <|im_end|>
    finally:
        serve.delete("demo")
