"""POST /tokenize and /detokenize in vLLM's shape, over a replica's app with the tiny model's real tokenizer and a
fake engine (no model, no Ray): token ids round-trip against the tokenizer, for a prompt and for chat messages,
bad bodies get OpenAI's 400 naming the field, and the routes sit behind the API key."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from engine.checkpoint.loader import load_tokenizer
from tests.app.fake_engine import FakeEngine

MODEL = "tiny"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def engine_over(tokenizer, max_model_len: int = 256) -> FakeEngine:
    """The fake engine with a real tokenizer and its vocabulary."""
    engine = FakeEngine(max_model_len=max_model_len)
    engine.tokenizer = tokenizer
    engine.model_config = SimpleNamespace(vocab_size=len(tokenizer))
    return engine


@pytest.fixture
async def client(tokenizer):
    engine = engine_over(tokenizer)
    app = build_replica_app(engine, ServeArgs(model=MODEL, api_key=KEY), ReplicaObservability(engine, MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=AUTH) as c:
        yield c


def template_ids(tokenizer, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def test_a_prompt_tokenizes_as_the_tokenizer_encodes_it_and_detokenizes_back(client, tokenizer):
    prompt = "Paged attention reads K and V through a block table."
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": 256, "tokens": tokenizer.encode(prompt)}
    assert len(set(body["tokens"])) > 5  # a real encoding, not one id repeated
    plain = await client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})  # model optional
    assert plain.json()["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    back = await client.post("/detokenize", json={"model": MODEL, "tokens": plain.json()["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": prompt}


async def test_messages_tokenize_as_the_chat_route_renders_them(client, tokenizer):
    r = await client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == template_ids(tokenizer, add_generation_prompt=True)
    chat = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]  # the prompt the engine is given
    back = await client.post("/detokenize", json={"tokens": tokens})
    assert back.json()["prompt"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    alone = await client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert alone.json()["tokens"] == template_ids(tokenizer, add_generation_prompt=False)
    assert len(alone.json()["tokens"]) < len(tokens)  # the assistant's turn is not opened


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", ["not", "an", "object"], None),
    ("/detokenize", {"tokens": [5, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1024]}, "tokens"),  # the tiny vocabulary is [0, 1024)
    ("/detokenize", {"tokens": "5 6"}, "tokens"),
])
async def test_bad_bodies_get_openais_400_naming_the_field(client, path, body, param):
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_another_models_name_is_a_404_and_a_missing_key_a_401(client):
    r = await client.post("/tokenize", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = await client.post(path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_the_openapi_schema_documents_both_forms_their_answers_and_the_key(client):
    published = (await client.get("/openapi.json")).json()
    tokenize = published["paths"]["/tokenize"]["post"]
    forms = tokenize["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    assert [f["$ref"].rsplit("/", 1)[-1] for f in forms] == ["TokenizeCompletionRequest", "TokenizeChatRequest"]
    assert set(published["components"]["schemas"]["TokenizeResponse"]["required"]) == {"count", "max_model_len",
                                                                                       "tokens"}
    detokenize = published["paths"]["/detokenize"]["post"]
    for operation in (tokenize, detokenize):
        assert {"200", "400", "401", "404", "413"} <= set(operation["responses"])
        assert operation["security"] == [{"bearerAuth": []}]
