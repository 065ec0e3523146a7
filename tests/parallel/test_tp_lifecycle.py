"""Tensor-parallel engines start side by side, fail loudly when a rank dies, and leave room for the next."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig, SamplingParams
from engine.errors import EngineDeadError
from engine.llm_engine import LLM

SETTINGS = dict(tensor_parallel_size=2, block_size=8, num_kv_blocks=64, max_model_len=256)
PROMPTS = [[1, 45, 300, 12, 999, 7, 64], [1, 800, 801, 5]]
MAX_TOKENS = 12


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def test_impossible_layouts_are_rejected_before_anything_starts(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(8\)"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 2, 4 or 8"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(180)
def test_two_tp2_engines_started_at_once_in_one_process_both_serve(tiny_llama_dir, tiny_qwen2_dir, hf_greedy):
    # two models, so an engine reading the other's collectives would produce wrong tokens
    model_dirs = [str(tiny_llama_dir), str(tiny_qwen2_dir)]
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(lambda d: LLM(d, **SETTINGS), model_dirs))
        try:
            outputs = list(pool.map(greedy, engines))
        finally:
            for llm in engines:
                llm.shutdown()
    assert outputs == [hf_greedy(d, PROMPTS, MAX_TOKENS, ignore_eos=True) for d in model_dirs]


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)  # a hang fails here; the failure itself comes at the first step after the kill
def test_killed_worker_fails_the_engine_with_a_clear_error_and_a_new_engine_starts(tiny_llama_dir, hf_greedy):
    llm = LLM(str(tiny_llama_dir), **SETTINGS)
    engine = llm.engine
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    ray.kill(engine.executor.workers[0])

    with pytest.raises(EngineDeadError, match=r"worker rank 1 died") as failure:
        while engine.has_unfinished_requests():  # the killed actor may finish a step before it goes
            engine.step()
    assert "actor" in str(failure.value).lower()
    with pytest.raises(EngineDeadError):  # dead stays dead, without touching the other ranks
        engine.step()
    llm.shutdown()

    replacement = LLM(str(tiny_llama_dir), **SETTINGS)
    try:
        assert greedy(replacement) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)
    finally:
        replacement.shutdown()


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_an_exception_on_a_worker_reaches_the_engine_as_its_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **SETTINGS)
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    # break rank 1's forward pass from inside its actor (the worker serves calls beside its step loop)
    worker = engine.executor.workers[0]
    ray.get(worker.__ray_call__.remote(lambda actor: setattr(actor.runner, "execute_model", None)))

    with pytest.raises(EngineDeadError, match=r"worker rank 1 raised TypeError: 'NoneType' object is not callable"):
        while engine.has_unfinished_requests():
            engine.step()
    llm.shutdown()


OFFLINE_SCRIPT = """
import json, sys
import ray
from engine.config import SamplingParams
from engine.llm_engine import LLM

assert not ray.is_initialized()
llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=8, num_kv_blocks=64, max_model_len=256)
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
print(json.dumps({"ray_started": ray.is_initialized(), "tokens": [o.outputs[0].token_ids for o in outputs]}))
llm.shutdown()
ray.shutdown()
"""


@pytest.mark.timeout(180)
def test_offline_llm_starts_a_local_ray_when_none_is_connected(tiny_llama_dir, hf_greedy):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the engine sets it too; the test never relies on that
    run = subprocess.run(
        [sys.executable, "-c", OFFLINE_SCRIPT, str(tiny_llama_dir), json.dumps(PROMPTS)],
        capture_output=True, text=True, env=env, timeout=170, cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"ray_started": True, "tokens": hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)}


def _live_placement_groups() -> set[str]:
    from ray.util import placement_group_table

    return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_an_engine_refused_at_startup_releases_its_placement_group(tiny_llama_dir):
    before = _live_placement_groups()
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, block_size=8, num_kv_blocks=4, max_model_len=256)
    assert _live_placement_groups() == before


def _assert_released(workers: list, placement_groups_before: set[str]) -> None:
    """The workers' actors are dead and no placement group is left beyond those there before."""
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.__ray_ready__.remote(), timeout=30)
    assert _live_placement_groups() <= placement_groups_before


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_dropping_the_last_reference_to_an_llm_releases_its_workers_and_placement_group(tiny_llama_dir):
    groups = _live_placement_groups()
    llm = LLM(str(tiny_llama_dir), **SETTINGS)
    greedy(llm)
    workers = llm.engine.executor.workers
    assert _live_placement_groups() != groups
    del llm  # no shutdown()
    gc.collect()
    _assert_released(workers, groups)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_leaving_a_with_block_releases_the_llm_and_shutting_down_again_does_nothing(tiny_llama_dir, hf_greedy):
    groups = _live_placement_groups()
    with LLM(str(tiny_llama_dir), **SETTINGS) as llm:
        assert greedy(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)
        workers = llm.engine.executor.workers
    _assert_released(workers, groups)
    llm.shutdown()
    llm.engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        greedy(llm)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_the_idle_warm_up_runs_on_every_rank_and_the_engine_stays_exact(tiny_llama_dir, hf_greedy):
    """Rank 0 hands each unit of the idle warm-up (engine/warmup.py LinearWarmUp) to the workers in place of a step:
    every rank runs the same units, and the steps after it are the same as before."""
    with LLM(str(tiny_llama_dir), **SETTINGS) as llm:
        executor = llm.engine.executor
        worker = executor.workers[0]
        units = len(executor.runner.linear_warm_up.units)
        assert units > 0 and ray.get(worker.warm_up_left.remote()) == units
        more = 0
        while llm.engine.warm_up_idle():
            more += 1
        assert more == units - 1 and executor.runner.linear_warm_up.done and not llm.engine.warm_up_idle()
        # a step after the warm-up: the worker has run every unit before it (one broadcast stream, in order)
        assert greedy(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)
        assert ray.get(worker.warm_up_left.remote()) == 0


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_a_dropped_async_engine_stops_its_loop_thread_and_releases_its_workers(tiny_llama_dir):
    groups = _live_placement_groups()
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", **SETTINGS))

    async def one_request(engine):
        async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), "r"):
            pass

    asyncio.run(one_request(engine))
    thread, workers = engine.loop_thread, engine.engine.executor.workers
    del engine  # no shutdown(): the finalizer stops the loop, the loop releases the engine
    gc.collect()
    assert not thread.is_alive()
    _assert_released(workers, groups)


FIVE_ENGINES_SCRIPT = """
import json, logging, sys
import ray
from engine.config import SamplingParams
from engine.llm_engine import LLM

ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
tokens = []
for _ in range(5):
    llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=8, num_kv_blocks=64, max_model_len=256)
    outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens.append([o.outputs[0].token_ids for o in outputs])
    del llm  # neither shutdown() nor gc.collect(): the reference count alone releases it
llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=8, num_kv_blocks=64, max_model_len=256)
print(json.dumps(tokens), flush=True)
# the last engine is left running: interpreter exit releases it
"""


@pytest.mark.timeout(240)
def test_five_tp2_engines_made_and_dropped_in_a_row_fit_in_one_process_on_two_cpus(tiny_llama_dir, hf_greedy):
    # each engine's group takes 2 x 0.5 of the 2 CPUs: one left behind and the third waits for ever
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    run = subprocess.run(
        [sys.executable, "-c", FIVE_ENGINES_SCRIPT, str(tiny_llama_dir), json.dumps(PROMPTS)],
        capture_output=True, text=True, env=env, timeout=230, cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr[-3000:]
    expected = hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [expected] * 5
