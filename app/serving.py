"""OpenAI completions and chat completions on top of one AsyncLLMEngine: prompts in, choices and SSE chunks out.

Each engine request's RequestRecord goes to `on_request_finished` (the replica's observability) when its final
delta arrives (app/engine_streams.py).
"""

from __future__ import annotations

import logging
import typing
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import ValidationError

from app.config import SamplingDefault
from app.engine_streams import OnRequestFinished, start_generation
from app.errors import EngineOverloadedError, ModelNotFoundError, engine_dead_error
from app.observability.records import RequestContext
from app.prompts import Prompt, chat_prompt, completion_prompts
from app.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from app.sse import SSE_DONE, sse, sse_error
from app.structured_outputs import OutputConstraint, named_for_the_request, output_constraint
from app.tool_calls.plan import plan_tool_calls
from app.tool_calls.streaming import ChoiceToolCalls, finish_reason, whole_message
from engine.config import SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("shardserve.api")


@dataclass
class ChoiceState:
    """What one choice has produced so far (accumulated for non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # where the next token's text starts in the choice's full text
    started: bool = False
    num_cached_tokens: int = 0  # of its prompt's tokens, those the prefix cache already held
    tool_calls: ChoiceToolCalls | None = None  # reads the choice's tool calls, where the request has them


# Sampling fields a request may leave out, and what they mean then when the server sets no default:
# the engine's own defaults.
NEUTRAL_SAMPLING: dict[str, float] = {
    name: SamplingParams.model_fields[name].default for name in typing.get_args(SamplingDefault)
}


class OpenAIServing:
    """Turns OpenAI request bodies into engine requests and engine deltas into OpenAI response bodies."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, max_waiting_requests: int,
                 default_sampling: dict[str, float] | None = None,
                 on_request_finished: OnRequestFinished | None = None, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None):
        self.engine = engine
        self.enable_auto_tool_choice = enable_auto_tool_choice  # and the parser: app/tool_calls/plan.py
        self.tool_call_parser = tool_call_parser
        self.on_request_finished = on_request_finished
        # what a request that leaves a sampling field or max_tokens out gets (app/model_defaults.py)
        self.default_sampling = {**NEUTRAL_SAMPLING, **(default_sampling or {})}
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.max_waiting_requests = max_waiting_requests
        self._token_text: dict[int, str] = {}

    # -- checks shared by both endpoints ------------------------------------------------------------

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.served_model_name, max_model_len=self.engine.max_model_len)])

    def check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist (this server serves `{self.served_model_name}`).")

    def check_capacity(self) -> None:
        waiting = self.engine.stats().num_waiting
        if waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"The server is overloaded: {waiting} requests are waiting (limit {self.max_waiting_requests}). "
                "Retry later."
            )

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                         logprobs: int | None, constraint: OutputConstraint | None = None) -> SamplingParams:
        """The request's sampling fields, with the server's defaults for those left out. What depends on the
        model (the context length, the vocabulary) the engine checks, once (engine/validation.py); max_tokens
        None asks for the rest of the context."""
        fields = {
            "n": req.n,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "temperature": self._or_default(req.temperature, "temperature"),
            "top_p": self._or_default(req.top_p, "top_p"),
            "top_k": int(self._or_default(req.top_k, "top_k")) or -1,
            "min_p": self._or_default(req.min_p, "min_p"),
            "seed": req.seed,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids or [],
            "ignore_eos": req.ignore_eos,
            "presence_penalty": self._or_default(req.presence_penalty, "presence_penalty"),
            "frequency_penalty": self._or_default(req.frequency_penalty, "frequency_penalty"),
            "repetition_penalty": self._or_default(req.repetition_penalty, "repetition_penalty"),
            "logprobs": logprobs,
            "skip_special_tokens": req.skip_special_tokens,
            # the keys' shape is the schema's (digits); the engine checks the vocabulary and the range
            "logit_bias": {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            "structured_outputs": constraint.params if constraint is not None else None,
        }
        try:
            return SamplingParams(**fields)  # an InvalidRequestError names its field (param)
        except ValidationError as e:
            first = e.errors()[0]
            raise InvalidRequestError(first["msg"], param=".".join(str(p) for p in first["loc"])) from None

    def _or_default(self, value: float | None, name: str) -> float:
        return self.default_sampling[name] if value is None else value

    def _max_tokens(self, requested: int | None, prompt: Prompt) -> int | None:
        """A request's max_tokens: its own, else the model's default (generation_config.json's max_new_tokens)
        where the context has room for it, as vLLM does; None: the rest of the context."""
        default = self.default_sampling.get("max_tokens")
        room = self.engine.max_model_len - len(prompt.token_ids)
        if requested is not None or default is None or room < 1:
            return requested
        return min(int(default), room)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # -- /v1/completions ----------------------------------------------------------------------------

    def _completion_logprobs(self, state: ChoiceState, token_ids: list[int],
                             logprobs: list[dict[int, float]], num_top: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, candidates in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(candidates.get(token_id))
            ranked = sorted(candidates.items(), key=lambda kv: -kv[1])[:num_top]
            top = {self.token_text(t): lp for t, lp in ranked}
            top.setdefault(text, candidates.get(token_id))  # like vLLM: the sampled token is always there
            out.top_logprobs.append(top)
            out.text_offset.append(state.text_offset)
            state.text_offset += len(text)
        return out

    async def create_completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported (no prompt logprobs).",
                                      param="echo")
        if req.suffix:
            raise InvalidRequestError("suffix is not supported.", param="suffix")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = completion_prompts(self.tokenizer, req)
        constraint = output_constraint(req)
        params = [self._sampling_params(req, self._max_tokens(req.max_tokens, p), req.logprobs, constraint)
                  for p in prompts]
        logger.info("%s: %d prompt(s), n=%d, stream=%s", request_id, len(prompts), req.n, req.stream)
        self.check_capacity()
        try:
            deltas = await start_generation(self.engine, request_id, prompts, params,
                                            RequestContext("text_completion", self.served_model_name),
                                            self.on_request_finished)
        except InvalidRequestError as e:
            raise named_for_the_request(e, constraint) from None
        states = [ChoiceState() for _ in range(len(prompts) * req.n)]
        echoes = [(p.text if p.text is not None else self.tokenizer.decode(p.token_ids)) if req.echo else ""
                  for p in prompts]
        for state, echo in zip(states, (e for e in echoes for _ in range(req.n)), strict=True):
            state.text_offset = len(echo)
        if req.stream:
            return self._completion_stream(req, request_id, prompts, states, echoes, deltas)
        async for prompt_index, delta in deltas:
            for out in delta.outputs:
                state = states[prompt_index * req.n + out.index]
                state.text += out.text
                state.token_ids += out.token_ids
                state.logprobs += out.logprobs or []
                state.finish_reason = out.finish_reason or state.finish_reason
                state.num_cached_tokens = delta.num_cached_tokens
        choices = []
        for i, state in enumerate(states):
            logprobs = None
            if req.logprobs is not None:
                state.text_offset = len(echoes[i // req.n])
                logprobs = self._completion_logprobs(state, state.token_ids, state.logprobs, req.logprobs)
            choices.append(CompletionChoice(index=i, text=echoes[i // req.n] + state.text, logprobs=logprobs,
                                            finish_reason=state.finish_reason))
        logger.info("%s: finished", request_id)
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                  usage=_usage(prompts, states, req.n))

    async def _completion_stream(self, req, request_id, prompts, states, echoes, deltas):
        include_usage = req.include_usage_chunk
        exclude = None if include_usage else {"usage"}
        try:
            async with aclosing(deltas):  # leaving early ends the engine requests now, not when collected
                async for prompt_index, delta in deltas:
                    choices = []
                    for out in delta.outputs:
                        index = prompt_index * req.n + out.index
                        state = states[index]
                        text = out.text if state.started else echoes[prompt_index] + out.text
                        state.started = True
                        state.token_ids += out.token_ids
                        state.num_cached_tokens = delta.num_cached_tokens
                        logprobs = None
                        if req.logprobs is not None:
                            logprobs = self._completion_logprobs(state, out.token_ids, out.logprobs or [],
                                                                 req.logprobs)
                        choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                        finish_reason=out.finish_reason))
                    if choices:
                        chunk = CompletionResponse(id=request_id, model=self.served_model_name, choices=choices)
                        yield sse(chunk.model_dump_json(exclude=exclude))
            if include_usage:
                chunk = CompletionResponse(id=request_id, model=self.served_model_name, choices=[],
                                           usage=_usage(prompts, states, req.n))
                yield sse(chunk.model_dump_json())
            logger.info("%s: finished", request_id)
        except Exception as e:  # the response has started: report in-band, as OpenAI does
            yield _stream_error_event(request_id, e)
        yield SSE_DONE

    # -- /v1/chat/completions -----------------------------------------------------------------------

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                       num_top: int) -> ChatChoiceLogprobs:
        content = []
        for token_id, candidates in zip(token_ids, logprobs, strict=True):
            ranked = sorted(candidates.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(ChatTokenLogprob(
                **_top_logprob(self.token_text(token_id), candidates.get(token_id, float("-inf"))),
                top_logprobs=[TopLogprob(**_top_logprob(self.token_text(t), lp)) for t, lp in ranked],
            ))
        return ChatChoiceLogprobs(content=content)

    async def create_chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        plan = plan_tool_calls(req.tools, req.tool_choice, req.parallel_tool_calls, self.enable_auto_tool_choice,
                               self.tool_call_parser)
        constraint = output_constraint(req, plan.schema if plan is not None else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = chat_prompt(self.tokenizer, req)
        max_tokens = self._max_tokens(req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens,
                                      prompt)
        num_top = req.top_logprobs or 0
        params = self._sampling_params(req, max_tokens, num_top if req.logprobs else None, constraint)
        logger.info("%s: %d message(s), n=%d, stream=%s", request_id, len(req.messages), req.n, req.stream)
        self.check_capacity()
        try:
            deltas = await start_generation(self.engine, request_id, [prompt], [params],
                                            RequestContext("chat", self.served_model_name), self.on_request_finished)
        except InvalidRequestError as e:
            if e.param != "prompt":
                raise named_for_the_request(e, constraint) from None
            raise InvalidRequestError(e.message, param="messages") from None  # a chat's prompt is its messages
        states = [ChoiceState(tool_calls=plan.choice_calls() if plan is not None else None) for _ in range(req.n)]
        if req.stream:
            return self._chat_stream(req, request_id, prompt, states, num_top, deltas)
        async for _, delta in deltas:
            for out in delta.outputs:
                state = states[out.index]
                state.text += out.text
                state.token_ids += out.token_ids
                state.logprobs += out.logprobs or []
                state.finish_reason = out.finish_reason or state.finish_reason
                state.num_cached_tokens = delta.num_cached_tokens
        choices = [
            ChatChoice(index=i, **_chat_message(state),
                       logprobs=self._chat_logprobs(state.token_ids, state.logprobs, num_top) if req.logprobs else None)
            for i, state in enumerate(states)
        ]
        logger.info("%s: finished", request_id)
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                      usage=_usage([prompt], states, req.n))

    async def _chat_stream(self, req, request_id, prompt, states, num_top, deltas):
        include_usage = req.include_usage_chunk
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=choices, usage=usage)
            return sse(body.model_dump_json(exclude=exclude))

        try:
            async with aclosing(deltas):  # leaving early ends the engine request now, not when collected
                # with tool calls to read, content may never come: then it stays null, as in the whole answer
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(
                    role="assistant", content="" if states[i].tool_calls is None else None)) for i in range(req.n)])
                async for _, delta in deltas:
                    choices = []
                    for out in delta.outputs:
                        state = states[out.index]
                        state.token_ids += out.token_ids
                        state.num_cached_tokens = delta.num_cached_tokens
                        logprobs = (self._chat_logprobs(out.token_ids, out.logprobs or [], num_top) if req.logprobs
                                    else None)
                        message, finish = DeltaMessage(content=out.text), out.finish_reason
                        if state.tool_calls is not None:
                            content, fragments = state.tool_calls.delta(out.text, finished=finish is not None)
                            message = DeltaMessage(content=content or None, tool_calls=fragments or None)
                            finish = finish_reason(finish, state.tool_calls.num_calls)
                        choices.append(ChatStreamChoice(index=out.index, delta=message, logprobs=logprobs,
                                                        finish_reason=finish))
                    if choices:
                        yield chunk(choices)
            if include_usage:
                yield chunk([], usage=_usage([prompt], states, req.n))
            logger.info("%s: finished", request_id)
        except Exception as e:  # the response has started: report in-band, as OpenAI does
            yield _stream_error_event(request_id, e)
        yield SSE_DONE


def _stream_error_event(request_id: str, e: Exception) -> str:
    """The in-band error event of a stream that failed after it started (the status line has gone out)."""
    if isinstance(e, EngineDeadError):  # the same body as the 503 a request gets before it starts
        logger.error("%s: the engine died mid-stream: %s", request_id, e)
        info = engine_dead_error(e)
    else:
        logger.exception("%s: failed mid-stream", request_id)
        info = ErrorInfo(message=str(e), type="InternalServerError")
    return sse_error(info)


def _chat_message(state: ChoiceState) -> dict:
    """A finished choice's `message` and `finish_reason`: its text, or the tool calls read from it."""
    if state.tool_calls is None:
        return {"message": AssistantMessage(content=state.text), "finish_reason": state.finish_reason}
    content, tool_calls = whole_message(state.tool_calls, state.text)
    return {"message": AssistantMessage(content=content, tool_calls=tool_calls),
            "finish_reason": finish_reason(state.finish_reason, len(tool_calls or []))}


def _usage(prompts: Sequence[Prompt], states: Sequence[ChoiceState], n: int) -> UsageInfo:
    """Token counts of a response whose prompts have `n` choices each (states in prompt order)."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(s.token_ids) for s in states)
    cached_tokens = sum(max(s.num_cached_tokens for s in states[i:i + n]) for i in range(0, len(states), n))
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def _top_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode("utf-8"))}
