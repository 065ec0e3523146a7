"""Shared fixtures: tiny random-weight model directories and the transformers greedy oracle."""

# These must be set before anything imports triton or ray (test modules, plugins, fixtures):
# - Triton reads TRITON_INTERPRET when it is first imported; kernels imported earlier in the
#   process without it fail under the interpreter (tl.cdiv / tl.range), and CPU tests need it.
# - Without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 Ray binds and talks on the machine's interface
#   address; with it every Ray port listens on 127.0.0.1 only (tests stay on loopback).
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.checkpoint.random_model import make_model  # noqa: E402

# The longest test files (a minute or more each on 2 cores), first: `make test`'s two processes take whole files
# in collection order, so the run does not end on one of these with the other process idle.
LONGEST_FILES_FIRST = [  # by each file's total in `make test --durations` (AVX2 EPYC, 2026-12-04)
    "tests/app/test_cli_serve.py",
    "tests/ops/test_ops_lint_script.py",  # ~60 s, ~3 minutes on a fresh machine (it creates .venv-ops)
    "tests/parallel/test_tp_exactness.py",
    "tests/app/test_direct_ingress.py",
    "tests/app/test_serve_scaling.py",
    "tests/bench/test_bench_real_server.py",
    "tests/cluster/test_node_autoscaling.py",
    "tests/parallel/test_tp_lifecycle.py",
    "tests/engine/test_gguf_cache.py",
    "tests/app/test_api_contract.py",
    "tests/reliability/test_serve_recovery.py",
    "tests/engine/test_real_model.py",
    "tests/app/test_serve_openai.py",
    "tests/reliability/test_load_and_bodies.py",
    "tests/cluster/test_placement.py",
    "tests/app/test_routing_replicas.py",
]


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
    root = Path(config.rootpath)
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(root).as_posix(), len(rank)))


# rope_scaling as Llama 3.1 writes it, scaled down to the tiny model's context.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama of random_model.py's tiny preset: 2 layers, hidden 256, intermediate 512, 4 query heads / 2 KV
    heads (GQA, head_dim 64), vocab 1024, 1024 positions, float32, untied embeddings."""
    return make_model("llama", "tiny", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_gqa_dir(tiny_llama_dir) -> Path:
    """The tiny Llama already uses grouped-query attention (4 query heads share 2 KV heads)."""
    return tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory) -> Path:
    """The tiny Llama with Llama 3's rope_scaling (factor 8 from 256 original positions)."""
    return make_model(
        "llama", "tiny", tmp_path_factory.mktemp("tiny-llama3-rope"), rope_scaling=LLAMA3_ROPE_SCALING
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2 of the tiny shape: q/k/v bias, tied embeddings."""
    return make_model("qwen2", "tiny", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3 of the tiny shape: q/k norms, no bias, head_dim 128 (not 256 / 4 heads), tied embeddings."""
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_looping_dir(tmp_path_factory) -> Path:
    """The tiny Llama at initializer_range 0.03: greedy outputs run a dozen diverse tokens, then fall into
    loops of 2 to 5 tokens, so n-gram speculation's proposals get accepted (and rejected where a loop ends)."""
    return make_model("llama", "tiny", tmp_path_factory.mktemp("tiny-llama-looping"), initializer_range=0.03)


@pytest.fixture(scope="session")
def tiny_llama_looping_draft_dir(tmp_path_factory) -> Path:
    """Another looping tiny Llama (seed 1), with the same tokenizer: a draft model whose proposals get rejected."""
    return make_model("llama", "tiny", tmp_path_factory.mktemp("tiny-llama-looping-draft"), seed=1,
                      initializer_range=0.03)


@pytest.fixture(scope="session")
def serve_cluster():
    """Local Ray (every port on loopback) and Serve's HTTP proxy on a free 127.0.0.1 port, once per session:
    tests/app and tests/reliability share it (a second `ray.init` in one process would fail)."""
    from tests.serve_cluster import local_serve_cluster

    with local_serve_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module", autouse=True)
def no_stray_ray_outlives_its_module():
    """A local Ray that an offline TP engine started for itself during a test module (ensure_ray, as in a
    user's script) is shut down after the module: the next module in this process finds no Ray, or only
    the session's Serve cluster. `make test` runs two processes, each taking whole files in no fixed order,
    so a later module must not inherit an earlier one's Ray with its CPU count and what was left on it."""
    import sys

    def stray() -> bool:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return False
        from tests.serve_cluster import RUNNING

        return not RUNNING

    before = stray()
    yield
    if not before and stray():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The demo model's file: SmolLM2-135M-Instruct, Q4_1 GGUF (fetched once per machine; `make install` does it)."""
    from engine.checkpoint.demo import ensure_demo_model

    return ensure_demo_model()


class HFGreedy:
    """transformers' greedy generate in float32, one prompt at a time: the exactness oracle.

    `hf_greedy(model_dir, [prompt_ids, ...], max_new_tokens)` -> the new token ids per prompt.
    Like the engine's default, generation stops after EOS (which is included); with
    ignore_eos=True it always returns max_new_tokens tokens. Results are cached per session.
    """

    def __init__(self):
        self._models: dict[str, torch.nn.Module] = {}
        self._results: dict[tuple, list[int]] = {}

    def __call__(
        self, model_dir, prompt_ids_list: list[list[int]], max_new_tokens: int, ignore_eos: bool = False
    ) -> list[list[int]]:
        outputs = []
        for prompt_ids in prompt_ids_list:
            key = (str(model_dir), tuple(prompt_ids), max_new_tokens, ignore_eos)
            if key not in self._results:
                self._results[key] = self._generate(
                    str(model_dir), list(prompt_ids), max_new_tokens, ignore_eos
                )
            outputs.append(list(self._results[key]))
        return outputs

    def model(self, model_dir) -> torch.nn.Module:
        """The transformers model of a directory, float32, loaded once per session."""
        from transformers import AutoModelForCausalLM

        key = str(model_dir)
        if key not in self._models:
            self._models[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        return self._models[key]

    @torch.inference_mode()
    def _generate(
        self, model_dir: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool
    ) -> list[int]:
        model = self.model(model_dir)
        generation_config = model.generation_config
        eos = None if ignore_eos else generation_config.eos_token_id
        input_ids = torch.tensor([prompt_ids])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=generation_config.eos_token_id,
        )
        return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_greedy() -> HFGreedy:
    return HFGreedy()
