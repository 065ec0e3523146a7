"""The engine: `step()` is schedule, run the model and sample, then the scheduler's update; then deltas.

`LLMEngine` is synchronous and single-threaded; `LLM` wraps it for offline batches and
`AsyncLLMEngine` (engine/async_engine.py) drives it from a background thread for serving.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from engine.config import EngineConfig, SamplingParams, available_cores
from engine.cpu_binding import allowed_cores, rank_lists, unbind_current_thread
from engine.detokenizer import Detokenizer
from engine.errors import InvalidRequestError
from engine.executor import Executor, make_executor
from engine.model_runner import prepare_step
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampler import SamplingBatch
from engine.scheduler import Scheduler
from engine.sequence import Request, Sequence
from engine.spec_decode.draft import DraftModelProposer, check_draft_vocabulary
from engine.spec_decode.verify import SpeculativeRow
from engine.stopping import StopChecker
from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.grammar import GrammarBitmask, SequenceGrammar, fill_bitmask
from engine.validation import check_request

RECENT_STEPS = 4096  # steps remembered for metrics between two scrapes


def overlaps_bitmask_fill(config: EngineConfig) -> bool:
    """Fill a step's grammar bitmask on a thread while the forward pass runs, as vLLM does, only where a core is
    free for it: on a GPU (the host only launches kernels meanwhile), or on a CPU with a core beyond the ranks'
    torch threads. Where the pass's OpenMP threads hold every core, the filler preempts one of them and each
    parallel region waits for it: on 2 cores the constrained load fell to 0.86-0.94x of the same load free with
    the fill overlapped, and ran at 1.00-1.04x filled before the pass (docs/BENCHMARKS.md, "Structured outputs")."""
    if config.resolved_device().type != "cpu":
        return True
    lists = rank_lists(config.cpu_threads_bind)
    if lists is not None:  # bound ranks: a core of this process's that no rank computes on
        return bool(allowed_cores() - {core for cores in lists for core in cores})
    return available_cores() > config.resolved_cpu_threads() * config.tensor_parallel_size


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from engine.checkpoint.loader import load_tokenizer
        from engine.checkpoint.model_config import load_model_config

        self.config = config
        self.model_config = load_model_config(config.model)
        self.max_model_len = config.resolve(self.model_config)
        # the tokenizer (transformers' import, ~2 s on 2 cores) loads while the executor starts its ranks and loads
        # the weights: a rebuilt engine serves that much sooner (docs/OPERATIONS.md, "Failures and recovery")
        with ThreadPoolExecutor(1, thread_name_prefix="shardserve-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, config.tokenizer or config.model)
            self.executor: Executor = make_executor(config, self.model_config, self.max_model_len)
            try:
                self.tokenizer = tokenizer.result()
            except BaseException:
                self.executor.shutdown()  # a tensor-parallel executor holds worker actors and a placement group
                raise
        num_blocks = self.executor.num_blocks
        if num_blocks * config.block_size < self.max_model_len:
            self.executor.shutdown()  # a tensor-parallel executor holds worker actors and a placement group
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens ({num_blocks} blocks of "
                f"{config.block_size}), fewer than max_model_len ({self.max_model_len}): give it more memory "
                f"(num_kv_blocks / kv_cache_memory_gb) or lower max_model_len"
            )
        eos = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.draft_proposer: DraftModelProposer | None = None
        if config.speculative_config is not None and config.speculative_config.method == "draft_model":
            try:
                self.draft_proposer = self._make_draft_proposer(num_blocks)
            except Exception:
                self.executor.shutdown()  # a tensor-parallel executor holds worker actors and a placement group
                raise
        self.scheduler = Scheduler(
            config,
            num_blocks,
            self.executor.num_host_blocks,
            StopChecker(tuple(eos), self.max_model_len, self.detokenizer),
            proposer=self.draft_proposer,
        )
        # structured outputs: constraints compiled for this tokenizer (engine/structured_output/), and, where a
        # core is free for it, the thread that fills a step's grammar bitmask while the forward pass runs
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, tuple(eos))
        self._bitmask_filler = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-bitmask",
                                                   initializer=unbind_current_thread)
                                if overlaps_bitmask_fill(config) else None)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_mixed_steps = 0  # steps where a prefill chunk shared the batch with decodes
        # (step number, tokens computed) of the latest steps: app/observability/metrics.py's tokens-per-step histogram
        self.recent_steps: deque[tuple[int, int]] = deque(maxlen=RECENT_STEPS)

    def _make_draft_proposer(self, num_blocks: int) -> DraftModelProposer:
        """The draft model of speculative_config, refused unless its vocabulary is the target's; its KV cache
        holds as many blocks as the target's plus one per sequence (for the proposals' slots)."""
        from engine.checkpoint.loader import load_tokenizer
        from engine.checkpoint.model_config import load_model_config

        draft = self.config.speculative_config.model
        draft_config = load_model_config(draft)
        check_draft_vocabulary(draft_config, self.model_config, load_tokenizer(draft), self.tokenizer)
        return DraftModelProposer(self.config, draft_config, num_blocks + self.config.max_num_seqs, self.max_model_len)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a sequence (the stop checker's; the sampler holds them back before min_tokens)."""
        return self.scheduler.stop_checker.eos_token_ids

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> Request:
        """Check a request against the model's limits and build it: the one place a request is validated
        (InvalidRequestError names the rule and the field). A text prompt is tokenized unless its token ids
        are given; max_tokens None means the rest of the context."""
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        params = check_request(prompt_token_ids, params, self.max_model_len, self.model_config.vocab_size)
        compiled = None
        if params.structured_outputs is not None:  # cached when the async engine compiled it beforehand
            compiled = self.grammar_compiler.compile(params.structured_outputs)
        request = Request(request_id, text, prompt_token_ids, params, arrival_time)
        if compiled is not None:
            for seq in request.seqs:  # n > 1: a matcher per choice
                seq.grammar = SequenceGrammar(compiled)
        return request

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Request:
        request = self.make_request(request_id, prompt, params, arrival_time)
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request`."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

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
        """Schedule one batch, run it, sample, let the scheduler update its sequences, and return a delta
        for every request that advanced."""
        scheduler = self.scheduler
        scheduler.swap_outs_done(self.executor.poll_swap_outs())
        sched = scheduler.schedule()
        if sched.is_empty:
            if sched.has_swaps:  # e.g. the only running sequence swapped itself out
                self.executor.execute_model(prepare_step(sched, self.config.block_size), None)
            elif scheduler.has_swap_outs_in_flight:  # nothing can run until a copy lands
                scheduler.swap_outs_done(self.executor.wait_swap_outs())
            return []
        self.num_steps += 1
        if sched.decodes and sched.prefills:
            self.num_mixed_steps += 1
        self.recent_steps.append((self.num_steps, sched.num_batched_tokens))
        sampling = None
        if sched.sampled_seqs:
            rows = sched.sampling_rows  # a speculating sequence has a row per position it verifies
            sampling = SamplingBatch(rows, self.eos_token_ids, self._fill_grammar_bitmask(rows))
        sampled = self.executor.execute_model(prepare_step(sched, self.config.block_size), sampling) or []
        advanced = scheduler.update_from_output(sched, sampled)
        return self._deltas(dict.fromkeys(seq.request for seq in advanced))

    def _fill_grammar_bitmask(self, rows: list[Sequence | SpeculativeRow]) -> Future[GrammarBitmask] | None:
        """The constrained rows' bitmask: started on the filler thread (the forward pass runs meanwhile), or,
        without one, filled here before the pass."""
        grammars = [(row, seq.grammar, seq.proposals if isinstance(seq, SpeculativeRow) else ())
                    for row, seq in enumerate(rows) if seq.grammar is not None]
        if not grammars:
            return None
        if self._bitmask_filler is not None:
            return self._bitmask_filler.submit(fill_bitmask, grammars, self.model_config.vocab_size)
        filled: Future[GrammarBitmask] = Future()
        filled.set_result(fill_bitmask(grammars, self.model_config.vocab_size))
        return filled

    def _deltas(self, requests: Iterable[Request]) -> list[RequestOutput]:
        outputs = []
        for request in requests:
            if request.is_finished:
                request.metrics.finished_time = time.time()
                del self.requests[request.request_id]
            outputs.append(self._delta(request))
        return outputs

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
            num_free_blocks=self.scheduler.block_manager.num_free_blocks,
            num_total_blocks=self.scheduler.block_manager.num_blocks,
            kv_cache_usage=self.scheduler.block_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_preemptions_by_mode=dict(self.scheduler.num_preemptions_by_mode),
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            speculation=replace(self.scheduler.spec_stats, acceptance_length_counts=list(
                self.scheduler.spec_stats.acceptance_length_counts)) if self.config.speculative_config else None,
        )

    def warm_up_idle(self) -> bool:
        """Work the executor can do while no request runs (oneDNN's primitives for the prefill steps' row buckets,
        engine/warmup.py), one unit a call; whether any is left. The async engine's loop calls it while idle."""
        return self.executor.warm_up_idle()

    def check_health(self) -> None:
        """Raise EngineDeadError if the executor lost a worker (cheap: the async engine calls it while idle)."""
        self.executor.check_health()

    def lost_rank(self) -> str | None:
        """A rank the executor lost that nobody has acted on yet (any thread; see Executor.lost_rank)."""
        return self.executor.lost_rank()

    def shutdown(self) -> None:
        """Release what the executor started (threads, worker actors, placement group); idempotent."""
        self.executor.shutdown()
        if getattr(self, "draft_proposer", None) is not None:  # (the KV check's shutdown comes before it)
            self.draft_proposer.shutdown()
        self.grammar_compiler.shutdown()
        if self._bitmask_filler is not None:
            self._bitmask_filler.shutdown(wait=False)


class LLM:
    """Offline batch generation: `LLM(model=dir).generate(prompts, SamplingParams(...))`.

    `shutdown()`, leaving a `with LLM(...) as llm:` block, dropping the last reference, or the
    interpreter's exit releases what it started (the executor's finalizer: engine/executor/tensor_parallel.py).
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
