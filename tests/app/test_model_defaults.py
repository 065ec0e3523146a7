"""What a request that leaves things out gets from the served model (app/model_defaults.py), through a replica's
request path over a fake engine (no model, no Ray), with the settings parsed from `shardserve serve` flags:
generation_config.json's sampling defaults (--generation-config auto, vllm or a folder, with
--override-generation-config on top) and the chat template (--chat-template, as text or as a file)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from app.cli import build_parser, serve_args_from
from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from engine.checkpoint.loader import load_tokenizer
from tests.app.fake_engine import FakeEngine

MAX_MODEL_LEN = 64
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def serve_args(*flags: str) -> ServeArgs:
    return serve_args_from(build_parser().parse_args(["serve", *flags]))


def client_for(engine: FakeEngine, args: ServeArgs) -> httpx.AsyncClient:
    app = build_replica_app(engine, args, ReplicaObservability(engine, "m"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def chat(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model directory whose generation_config.json recommends its own sampling (as many instruct models do)."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "max_new_tokens": 8, "do_sample": True, "eos_token_id": 2}))
    return tmp_path


async def test_a_request_that_leaves_sampling_out_gets_the_models_generation_config(model_dir):
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    async with client_for(engine, serve_args(str(model_dir))) as client:  # --generation-config auto
        for body in (chat(str(model_dir)),
                     {"model": str(model_dir), "prompt": "x" * 60, "max_tokens": None, "temperature": 0.3},
                     chat(str(model_dir), max_tokens=3, top_k=5)):
            r = await client.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
            assert r.status_code == 200, r.text
    assert [(p.temperature, p.top_k, p.max_tokens) for p in engine.sampling_params] == [
        (0.6, 20, 8),  # max_new_tokens is the default max_tokens
        (0.3, 20, 4),  # ...within what the context has left
        (0.6, 5, 3),   # what a request sets wins
    ]


async def test_generation_config_vllm_ignores_the_models_file(model_dir):
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    async with client_for(engine, serve_args(str(model_dir), "--generation-config", "vllm")) as client:
        r = await client.post("/v1/chat/completions", json=chat(str(model_dir)))
        assert r.status_code == 200, r.text
    [params] = engine.sampling_params
    prompt_len = len("<user>hi\n<assistant>")  # the fake tokenizer's template, one token per byte
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, -1, MAX_MODEL_LEN - prompt_len)


async def test_a_generation_config_folder_applies_under_the_overrides(model_dir):
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    args = serve_args("--model", "m", "--generation-config", str(model_dir),
                      "--override-generation-config", '{"temperature": 0.1}')
    async with client_for(engine, args) as client:
        assert (await client.post("/v1/chat/completions", json=chat("m"))).status_code == 200
    [params] = engine.sampling_params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.1, 20, 8)


def test_a_generation_config_folder_without_the_file_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--generation-config: generation_config must be auto, vllm or a folder"):
        serve_args("--generation-config", str(tmp_path))


async def test_a_chat_template_given_as_text_or_as_a_file_renders_the_prompt(tiny_llama_dir, tmp_path):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    rendered = {}
    for given in (None, CHAT_TEMPLATE, str(template_file)):
        tokenizer = load_tokenizer(tiny_llama_dir)  # each app its own: the template is set on it
        engine = FakeEngine(max_model_len=256)
        engine.tokenizer, engine.model_config = tokenizer, SimpleNamespace(vocab_size=len(tokenizer))
        args = serve_args("--model", "m", *(["--chat-template", given] if given else []))
        async with client_for(engine, args) as client:
            tokens = (await client.post("/tokenize", json=chat("m"))).json()["tokens"]
            chat_reply = await client.post("/v1/chat/completions", json=chat("m", max_tokens=1))
        assert chat_reply.json()["usage"]["prompt_tokens"] == len(tokens)  # what the engine is given
        rendered[given] = tokenizer.decode(tokens)
    assert rendered[CHAT_TEMPLATE] == rendered[str(template_file)] == "[user] hi\n[assistant] "
    assert rendered[None] != rendered[CHAT_TEMPLATE]  # the tokenizer's own template otherwise


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused():
    with pytest.raises(SystemExit, match="--chat-template: .* no such file"):
        serve_args("--chat-template", "/no/such/template.jinja")
