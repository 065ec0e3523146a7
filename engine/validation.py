"""The rules a request must meet before the engine takes it, checked in one place (`check_request`).

The API layer checks only the shape of a body (pydantic); everything that depends on the model (its
context length, its vocabulary) is checked here, once, whether the request came through HTTP, the async
engine or the offline `LLM`. Each rule has one message, in OpenAI's wording where OpenAI has one.
"""

from __future__ import annotations

from engine.config import SamplingParams
from engine.errors import InvalidRequestError


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int
) -> SamplingParams:
    """Raise InvalidRequestError, naming the field, for a request the model cannot serve; returns the
    params with max_tokens resolved (None: what is left of the context)."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("The prompt is empty: send at least one token.", param="prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"Prompt token id {bad} is outside the vocabulary [0, {vocab_size}).", param="prompt"
        )
    bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"logit_bias names token id {bad}, outside the vocabulary [0, {vocab_size}).", param="logit_bias"
        )
    if params.max_tokens is None:
        if num_prompt >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_prompt} tokens. Please shorten the prompt.",
                param="prompt",
            )
        return params.model_copy(update={"max_tokens": max_model_len - num_prompt})
    if num_prompt + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, {params.max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return params
