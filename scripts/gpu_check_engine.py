"""scripts/gpu_check.py's engine steps: a TP=1 engine on the device with the demo model (start-up, the KV
cache its profile sized, two engines at once, Triton against the references' greedy tokens), decode
tokens/s against the HBM copy rate, the swap path, and TP=2 as two processes on the one GPU through a
stand-in gloo group (NCCL refuses two ranks on one device), against TP=1.

Each engine is shut down, and its memory handed back, before the next starts: only the two-engine step
runs two at once, each with its share (gpu_memory_utilization 0.3).
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch

from scripts.gpu_check_kernels import Mismatch, Target

GPU_SHARE = 0.3  # each engine's gpu_memory_utilization: two fit at once
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 37, 120))]


def tiny_model(report) -> str:
    """A random tiny Llama (2 layers, 4 query heads over 2 KV heads), made once: the rehearsal's engine, and
    TP=2's (the demo model's 9 heads do not split in two)."""
    if "tiny_model" not in report.facts:
        from engine.checkpoint.random_model import make_model

        report.facts["tiny_model"] = str(make_model("llama", "tiny", Path(tempfile.mkdtemp(prefix="gpu-check-tiny-"))))
    return report.facts["tiny_model"]


def engine_model(target: Target, args, report) -> str:
    """The demo model (carried in parts, or in this machine's cache), else a random bench-shape Llama; the
    rehearsal runs the tiny one (it checks the plumbing)."""
    if "model" in report.facts:
        return report.facts["model"]
    from engine.checkpoint.demo import DEMO_FILE, DEMO_SHA256, default_demo_model_path

    path, label = None, ""
    if not target.on_gpu:
        path, label = tiny_model(report), "a random tiny Llama (the rehearsal checks the plumbing, not the model)"
    elif args.demo_parts:
        path = Path(tempfile.mkdtemp(prefix="gpu-check-demo-")) / DEMO_FILE
        path.write_bytes(b"".join(part.read_bytes() for part in args.demo_parts))
        if hashlib.sha256(path.read_bytes()).hexdigest() != DEMO_SHA256:
            raise Mismatch(f"the demo model's parts {args.demo_parts} do not add up to {DEMO_FILE}")
        label = "the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF, carried in two parts)"
    elif default_demo_model_path().is_file():
        path, label = default_demo_model_path(), "the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF)"
    else:
        from engine.checkpoint.random_model import make_model

        path = make_model("llama", "bench", Path(tempfile.mkdtemp(prefix="gpu-check-model-")))
        label = "a random bench-shape Llama (8 layers, vocab 32,000): the demo model was not carried"
    report.row(f"engine model: {label}")
    report.facts["model"] = str(path)
    return str(path)


def release(llm) -> None:
    """Shut an engine down and give its device memory back before the next one starts."""
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_llm(target: Target, model: str, **settings):
    from engine import LLM

    defaults = dict(dtype=str(target.dtype).removeprefix("torch."), kernel_backend=target.engine_backend,
                    device=target.device, max_num_batched_tokens=2048, max_model_len=1024, max_num_seqs=64)
    if target.on_gpu and "num_kv_blocks" not in settings:
        defaults["gpu_memory_utilization"] = GPU_SHARE
    return LLM(model, **(defaults | settings))


def greedy(llm, prompts=PROMPTS, max_tokens: int = 16) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def engine_steps(target: Target, report, args, part: str) -> None:
    """part "tp1": start-up, two engines, decode tokens/s, Triton vs references; "rest": swap and TP=2."""
    with report.step("engine model"):
        model = engine_model(target, args, report)
    if "model" not in report.facts:
        return
    if part == "tp1":
        tp1_steps(target, report, model)
    else:
        with report.step("swap path"):
            swap_path(target, report, model)
        with report.step("TP=2 stand-in vs TP=1"):
            tp2_stand_in(target, report, tiny_model(report))


def tp1_steps(target: Target, report, model: str) -> None:
    llm = None
    with report.step("engine TP=1 start-up"):
        start = time.monotonic()
        llm = make_llm(target, model)
        seconds = time.monotonic() - start
        memory = llm.engine.executor.memory()[0]
        report.row(f"engine TP=1, {target.engine_backend} kernels, {target.dtype}: start-up (load, profile, warm-up)",
                   f"{seconds:.1f} s", f"{llm.engine.executor.num_blocks} KV blocks, {memory.kv_cache_bytes / 2**30:.2f} GiB",
                   f"weights {memory.weight_bytes / 2**30:.2f} GiB")
    if llm is None:
        return
    with report.step("first request"):
        start = time.monotonic()
        greedy(llm, PROMPTS[:1], max_tokens=1)
        report.row("first request (1 token, after the warm-up)", f"{(time.monotonic() - start) * 1e3:.0f} ms")
        report.facts["kernel_tokens"] = greedy(llm)
    if target.on_gpu:
        with report.step("two engines at once"):
            second = make_llm(target, model)
            report.row(f"two engines alive at {GPU_SHARE} each", f"{llm.engine.executor.num_blocks} and "
                       f"{second.engine.executor.num_blocks} KV blocks")
            release(second)
    with report.step("decode tokens/s"):
        decode_rate(target, report, llm)
    release(llm)
    with report.step("kernels vs references, greedy"):
        reference = make_llm(target, model, kernel_backend="torch")
        want = greedy(reference)
        release(reference)
        got = report.facts.get("kernel_tokens", [])
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        total = sum(len(w) for w in want)
        report.row("engine greedy tokens, kernels vs torch references", f"{same} of {total} equal",
                   f"{target.dtype} (bfloat16 rounding may part them after a few tokens)")


def decode_rate(target: Target, report, llm) -> None:
    """Decode steps alone (the prompts prefilled first): tokens/s, and the bytes each step reads (weights and
    the K/V so far) per second against the copy rate."""
    from engine import SamplingParams

    engine = llm.engine
    batch, prompt_len, new_tokens = (32, 128, 128) if target.on_gpu else (4, 32, 8)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{i}", [(11 * i + j) % 900 + 3 for j in range(prompt_len)], params)
    while engine.scheduler.waiting:  # the prompts' prefill, not timed
        engine.step()
    memory = engine.executor.memory()[0]
    weights = memory.weight_bytes
    per_token_kv = memory.kv_cache_bytes // (engine.executor.num_blocks * engine.config.block_size)  # K, V, all layers
    steps, tokens, read = 0, 0, 0
    if target.on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        running = list(engine.scheduler.running)
        read += weights + per_token_kv * sum(seq.num_tokens for seq in running)
        tokens += len(running)
        engine.step()
        steps += 1
    if target.on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    gbs = read / seconds / 1e9
    copy = report.facts.get("copy_gbs")
    report.row(f"decode batch {batch}, {new_tokens} tokens each", f"{tokens / seconds:.0f} tokens/s",
               f"{seconds / steps * 1e3:.2f} ms a step", f"{gbs:.0f} GB/s read"
               + (f", {gbs / copy:.0%} of copy" if copy else ""))


def swap_path(target: Target, report, model: str) -> None:
    """Sequences swapped out to host memory and back must generate what they generate unpreempted."""
    prompts = [[(13 * i + j) % 700 + 3 for j in range(64)] for i in range(8)]
    new_tokens = 64 if target.on_gpu else 24  # 8 x 88 tokens still need twice the 24 blocks
    roomy = make_llm(target, model, num_kv_blocks=512, max_model_len=256)
    want = greedy(roomy, prompts, max_tokens=new_tokens)
    release(roomy)
    tight = make_llm(target, model, num_kv_blocks=24, max_model_len=256, preemption_mode="swap", swap_space=0.5,
                     max_num_seqs=8)
    got = greedy(tight, prompts, max_tokens=new_tokens)
    swaps = tight.engine.stats().num_preemptions_by_mode.get("swap", 0)
    release(tight)
    if swaps == 0:
        raise Mismatch("no sequence was swapped out: the check did not reach the swap path")
    if got != want:
        raise Mismatch(f"swapped sequences generated other tokens: {sum(g != w for g, w in zip(got, want))} of 8 differ")
    report.row("swap path: 8 sequences in 24 blocks", f"{swaps} swap-outs", "tokens equal to unpreempted")


def _step_for(prompts: list[list[int]], block_size: int):
    """A prefill step of whole prompts in fresh blocks, as the scheduler would hand it out."""
    from engine.config import SamplingParams
    from engine.model_runner import prepare_step
    from engine.scheduler import ScheduledChunk, SchedulerOutput
    from engine.sequence import Request

    chunks, next_block = [], 0
    for i, prompt in enumerate(prompts):
        seq = Request(f"tp-{i}", None, prompt, SamplingParams()).seqs[0]
        blocks = -(-len(prompt) // block_size)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        chunks.append(ScheduledChunk(seq, len(prompt)))
    return prepare_step(SchedulerOutput(prefills=chunks), block_size)


def _runner(model: str, target: Target, tp: int, parallel=None):
    from engine.checkpoint.model_config import load_model_config
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    config = EngineConfig(model=model, dtype="float32", device=target.device, kernel_backend=target.engine_backend,
                          tensor_parallel_size=tp, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512)
    return ModelRunner(config, load_model_config(model), parallel=parallel, num_blocks=64, max_model_len=512)


def _tp_rank(rank: int, port: int, model: str, target: Target, out: str) -> None:
    """One rank of the stand-in TP=2 engine, in its own process: its shard's logits of the step (rank 0 saves them)."""
    from parallel.state import connect_store, init_parallel_context

    store = connect_store("127.0.0.1", port, 2)
    device = torch.device(target.device, 0) if target.on_gpu else None
    parallel = init_parallel_context(store, rank, 2, target.device, device=device, tensor_backend="gloo")
    runner = _runner(model, target, 2, parallel)
    logits = runner.compute_logits(_step_for(PROMPTS, runner.config.block_size))
    if rank == 0:
        torch.save(logits.cpu(), out)
    # out without the interpreter's teardown, where the groups' threads, destroyed in no fixed order, can
    # abort the process ("terminate called without an active exception") after the work is done
    os._exit(0)


def tp2_stand_in(target: Target, report, model: str) -> None:
    """TP=2 in float32 as two processes on one device (gloo carries the collectives) against TP=1's logits."""
    from parallel.state import create_store

    runner = _runner(model, target, 1)
    want = runner.compute_logits(_step_for(PROMPTS, runner.config.block_size)).cpu()
    del runner
    gc.collect()
    store = create_store(2)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "logits.pt")
        ranks = [context.Process(target=_tp_rank, args=(rank, store.port, model, target, out)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=600)
        if any(process.exitcode != 0 for process in ranks):
            raise Mismatch(f"a TP=2 rank failed (exit codes {[p.exitcode for p in ranks]})")
        got = torch.load(out)
    error = float((got - want).abs().max() / want.abs().max())
    if error > 1e-4 or not torch.equal(got.argmax(-1), want.argmax(-1)):
        raise Mismatch(f"TP=2 logits differ from TP=1's: relative error {error:.1e}")
    report.row("TP=2 (two processes, one device, gloo) vs TP=1, float32", f"relative logit error {error:.1e}",
               "greedy tokens equal")
