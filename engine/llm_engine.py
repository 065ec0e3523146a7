"""The engine: `step()` is schedule, run the model, then process what it produced.

`LLMEngine` is synchronous and single-threaded; `LLM` wraps it for offline batches and
`AsyncLLMEngine` (engine/async_engine.py) drives it from a background thread for serving.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as SequenceABC

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, SamplingParams
from engine.detokenizer import Detokenizer
from engine.errors import InvalidRequestError
from engine.model_runner import ModelRunner, prepare_step
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence
from kernels.backend import get_backend

RECENT_STEPS = 4096  # steps remembered for metrics between two scrapes


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from engine.loader import load_tokenizer

        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = config.resolve(self.model_config).max_model_len
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.executor = self._make_executor()
        num_blocks = self.executor.num_blocks
        if num_blocks * config.block_size < self.max_model_len:
            self.shutdown()  # a tensor-parallel executor holds worker actors and a placement group
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens ({num_blocks} blocks of "
                f"{config.block_size}), fewer than max_model_len ({self.max_model_len}): give it more memory "
                f"(num_kv_blocks / kv_cache_memory_gb) or lower max_model_len"
            )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            # 0 (swap preemption falls back to recompute) for an executor without a host pool
            num_host_blocks=getattr(self.executor, "num_host_blocks", 0),
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.detokenizer = Detokenizer(self.tokenizer)
        # rank 0's logits are sampled where they were computed, by that device's fused sampler
        self.sampling_backend = get_backend(config.kernel_backend, config.resolved_device().type)
        eos = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_mixed_steps = 0  # steps where a prefill chunk shared the batch with decodes
        # (step number, tokens computed) of the latest steps: app/metrics.py's tokens-per-step histogram
        self.recent_steps: deque[tuple[int, int]] = deque(maxlen=RECENT_STEPS)

    def _make_executor(self):
        if self.config.tensor_parallel_size == 1:
            return ModelRunner(self.config, self.model_config, max_model_len=self.max_model_len)
        from parallel.workers import TensorParallelExecutor

        return TensorParallelExecutor(self.config, self.model_config, max_model_len=self.max_model_len)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError, naming the limit, for a request that cannot be served."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty: send at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, {params.max_tokens} in "
                f"the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_request(token_ids, params)
        request = Request(request_id, text, token_ids, params, arrival_time)
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final delta."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        request.metrics.finished_time = time.time()
        return self._delta(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, sample, and return a delta for every request that advanced."""
        self._release_swapped_out(getattr(self.executor, "poll_swap_outs", list)())
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.has_swaps:  # e.g. the only running sequence swapped itself out
                self.executor.execute_model(prepare_step(sched, self.config.block_size))
            elif self.block_manager.swap_outs_in_flight:  # nothing can run until a copy lands
                self._release_swapped_out(self.executor.wait_swap_outs())
            return []
        self.num_steps += 1
        if sched.decodes and sched.prefills:
            self.num_mixed_steps += 1
        self.recent_steps.append((self.num_steps, sched.num_batched_tokens))
        logits = self.executor.execute_model(prepare_step(sched, self.config.block_size))
        return self._process(sched, logits)

    def _release_swapped_out(self, tickets: list[int]) -> None:
        for ticket in tickets:
            self.block_manager.complete_swap_out(ticket)

    def _process(self, sched: SchedulerOutput, logits) -> list[RequestOutput]:
        to_sample: list[Sequence] = []
        touched: dict[str, Request] = {}
        for chunk in sched.chunks:
            if chunk.completes_sequence:
                to_sample.append(chunk.seq)
            chunk.seq.num_computed_tokens += chunk.num_tokens
        if to_sample:
            now = time.time()
            for seq, token in zip(to_sample, sample(logits, to_sample, self.eos_token_ids, self.sampling_backend)):
                seq.append_token(token.token_id, token.logprobs)
                request = seq.request
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                self._check_stop(seq, token.token_id)
                touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.is_finished:
                request.metrics.finished_time = time.time()
                del self.requests[request.request_id]
            outputs.append(self._delta(request))
        return outputs

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.sampling_params
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token_id in params.stop_token_ids:
            self.scheduler.finish(seq, "stop", token_id)
            return
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            self.scheduler.finish(seq, "stop")
            return
        stop_string = self.detokenizer.append_token(seq)
        if stop_string is not None and may_stop:
            self.scheduler.finish(seq, "stop", stop_string)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _delta(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            new_ids = seq.output_token_ids[seq.num_emitted_tokens :]
            text = self.detokenizer.take_new_text(seq)
            reports_finish = seq.is_finished and not seq.finish_reported
            if not new_ids and not text and not reports_finish:
                continue
            logprobs = None
            if seq.sampling_params.logprobs is not None:
                logprobs = seq.logprobs[seq.num_emitted_tokens :]
            seq.num_emitted_tokens = seq.num_output_tokens
            seq.finish_reported = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=new_ids,
                    logprobs=logprobs,
                    cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            num_cached_tokens=max(seq.num_cached_tokens for seq in request.seqs),
            metrics=request.metrics,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_swapped=len(self.scheduler.swapped),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_preemptions_by_mode=dict(self.scheduler.num_preemptions_by_mode),
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
        )

    def check_health(self) -> None:
        """Raise EngineDeadError if the executor lost a worker (cheap: the async engine calls it while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release what the executor started (threads, worker actors, placement group); idempotent."""
        self.executor.shutdown()


class LLM:
    """Offline batch generation: `LLM(model=dir).generate(prompts, SamplingParams(...))`.

    `shutdown()`, leaving a `with LLM(...) as llm:` block, dropping the last reference, or the
    interpreter's exit releases what it started (the executor's finalizer: parallel/workers.py).
    """

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str] | SequenceABC[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            request_id = str(self._next_id)
            self._next_id += 1
            try:
                request = self.engine.add_request(request_id, prompt, p)
            except Exception:
                for added in order:  # leave the engine as it was
                    self.engine.abort_request(added)
                raise
            order.append(request_id)
            results[request_id] = RequestOutput(
                request_id, request.prompt, request.prompt_token_ids, [], finished=False
            )
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                results[delta.request_id].merge(delta)
        return [results[request_id] for request_id in order]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
