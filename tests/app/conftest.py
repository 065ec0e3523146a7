"""The tiny model served through the real HTTP path, on the session's Serve cluster (tests/conftest.py)."""

from __future__ import annotations

import pytest

from app.config import ServeArgs
from tests.serve_cluster import free_port  # noqa: F401 — tests import it from here

API_KEY = "test-key"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512


def tiny_serve_args(model_dir, **overrides) -> ServeArgs:
    fields = dict(model=str(model_dir), served_model_name=SERVED_NAME, dtype="float32", max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=64, max_request_body_bytes=16384, cpus_per_rank=0.5, num_replicas=1,
                  api_key=API_KEY)
    return ServeArgs(**(fields | overrides))


@pytest.fixture(scope="session")
def served_tiny(serve_cluster, tiny_llama_dir):
    """The tiny Llama behind Serve at route prefix "/" (one replica, API key required)."""
    from ray import serve

    from app.deployment import build_app

    handle = serve.run(build_app(tiny_serve_args(tiny_llama_dir)), name="tiny", route_prefix="/")
    yield serve_cluster, handle
    serve.delete("tiny")


@pytest.fixture(scope="session")
def offline_llm(tiny_llama_dir):
    """The in-process engine on the same weights: the expected greedy text."""
    from engine import LLM

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()
