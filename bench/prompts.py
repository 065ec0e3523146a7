"""Benchmark prompts of an exact token length, built from random token ids of the served model's tokenizer."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

Endpoint = Literal["completions", "chat"]

# Re-encoding a decoded string of random ids merges and splits tokens; a handful of trim/pad rounds
# brings the count to the target, and a fresh draw handles the rare string that oscillates.
_ADJUST_ROUNDS = 16
_FRESH_DRAWS = 8


class PromptLengthError(ValueError):
    """No prompt of the requested token length could be built with this tokenizer."""


def load_tokenizer(tokenizer_dir: str):
    """A Hugging Face tokenizer from a local directory; nothing is downloaded."""
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(
            f"tokenizer directory {tokenizer_dir!r} does not exist: pass --tokenizer DIR, "
            "a local Hugging Face model or tokenizer directory"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def round_trip_token_ids(tokenizer) -> np.ndarray:
    """Ids of ordinary tokens whose text encodes back to the same single id (the pool prompts are drawn from)."""
    special = set(tokenizer.all_special_ids)
    candidates = [i for i in range(len(tokenizer)) if i not in special]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: ~5x faster over a 32k vocabulary
        texts = backend.decode_batch([[i] for i in candidates])
        encoded = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        texts = tokenizer.batch_decode([[i] for i in candidates])
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    pool = [i for i, text, ids in zip(candidates, texts, encoded, strict=True) if text.strip() and ids == [i]]
    if not pool:
        raise PromptLengthError("the tokenizer has no token whose text round-trips to itself")
    return np.asarray(pool, dtype=np.int64)


class PromptBuilder:
    """Builds prompt texts that the server will count as exactly `prompt_tokens` tokens.

    The count is the one the server reports in `usage.prompt_tokens`: for /v1/completions the text
    plus the tokenizer's special tokens (BOS), for /v1/chat/completions the chat template's output
    around a single user message. Prompts are distinct (fresh random ids each) unless a shared
    prefix of `shared_prefix_tokens` tokens is asked for, which every prompt then starts with; with
    `num_shared_prefixes` > 1 there are that many distinct prefixes, and each prompt starts with one
    drawn at random.
    """

    def __init__(
        self,
        tokenizer,
        prompt_tokens: int,
        endpoint: Endpoint = "completions",
        shared_prefix_tokens: int = 0,
        seed: int = 0,
        num_shared_prefixes: int = 1,
    ):
        if prompt_tokens < 1:
            raise PromptLengthError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        if not 0 <= shared_prefix_tokens < prompt_tokens:
            raise PromptLengthError(
                f"shared_prefix_tokens ({shared_prefix_tokens}) must be below prompt_tokens ({prompt_tokens})"
            )
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.endpoint = endpoint
        self.rng = np.random.default_rng(seed)
        self.pool = round_trip_token_ids(tokenizer)
        self.count_tokens = self._server_token_counter()
        self.overhead = self.count_tokens("")  # BOS for completions, the template around a chat message
        if self.overhead >= prompt_tokens:
            raise PromptLengthError(
                f"the {endpoint} endpoint adds {self.overhead} tokens around the prompt; "
                f"--prompt-tokens {prompt_tokens} leaves no room for content"
            )
        if num_shared_prefixes < 1:
            raise PromptLengthError(f"num_shared_prefixes must be >= 1, got {num_shared_prefixes}")
        self.prefixes = ([self._shared_prefix(shared_prefix_tokens) for _ in range(num_shared_prefixes)]
                         if shared_prefix_tokens else [""])

    @property
    def prefix(self) -> str:
        """The (first) shared prefix; "" without one."""
        return self.prefixes[0]

    def build(self, num_prompts: int) -> list[str]:
        """`num_prompts` new prompts, each counted by the server as exactly `prompt_tokens` tokens."""
        return [self._one_prompt() for _ in range(num_prompts)]

    def render(self, prompt: str) -> str:
        """The text sent for a prompt: the prompt itself, built for its endpoint already."""
        return prompt

    def _raw_len(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _server_token_counter(self) -> Callable[[str], int]:
        tokenizer = self.tokenizer
        if self.endpoint == "chat":
            if not getattr(tokenizer, "chat_template", None):
                raise PromptLengthError(
                    "the tokenizer has no chat_template, so chat prompt lengths cannot be counted; "
                    "use --endpoint completions or a tokenizer directory with a chat template"
                )

            def count_chat(text: str) -> int:
                encoded = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
                ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
                return len(ids)

            return count_chat
        return lambda text: len(tokenizer(text)["input_ids"])

    def _draw(self, n: int) -> list[int]:
        return self.rng.choice(self.pool, size=n).tolist() if n > 0 else []

    def _shared_prefix(self, num_tokens: int) -> str:
        return self._fit(self._raw_len, num_tokens)

    def _one_prompt(self) -> str:
        prefix = self.prefixes[int(self.rng.integers(len(self.prefixes)))] if len(self.prefixes) > 1 else self.prefix
        return prefix + self._fit(lambda text: self.count_tokens(prefix + text), self.prompt_tokens)

    def _fit(self, count: Callable[[str], int], target: int) -> str:
        """Text `t` with count(t) == target, from random ids trimmed or padded until the count is exact."""
        for _ in range(_FRESH_DRAWS):
            ids = self._draw(target - count(""))
            for _ in range(_ADJUST_ROUNDS):
                text = self.tokenizer.decode(ids)
                excess = count(text) - target
                if excess == 0:
                    return text
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids = ids[: len(ids) - excess] if excess > 0 else ids + self._draw(-excess)
        raise PromptLengthError(f"could not build a prompt of exactly {target} tokens with this tokenizer")


def expected_prompt_tokens(builder: PromptBuilder, prompts: Sequence[str]) -> list[int]:
    """What the server should report as usage.prompt_tokens for each prompt (for mismatch checks)."""
    return [builder.count_tokens(p) for p in prompts]
