"""Compiling a request's constraint (`StructuredOutputsParams`) into an xgrammar grammar, off the step loop.

One `GrammarCompiler` per engine, for its tokenizer: compiles run on its own worker thread and are kept
in an LRU cache keyed by the constraint (so, with the compiler's tokenizer, by (grammar, tokenizer)).
A constraint that fails to compile is remembered too, as its InvalidRequestError. The async engine
awaits `submit()` before it admits a request, so a compile never holds up a step and a bad grammar is
a 400 before the request reaches the scheduler; the offline engine calls `compile()`.

xgrammar is imported on the first constrained request, so an engine that never sees one never pays
for it (its tokenizer table takes ~0.1-1 s to build).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.config import StructuredOutputsParams
from engine.cpu_binding import unbind_current_thread
from engine.errors import InvalidRequestError

logger = logging.getLogger("shardserve.engine")

CACHE_SIZE = 512  # compiled grammars kept (a 10-field JSON schema's is ~100 KB at vocab 32k)
# Whitespace one JSON gap may hold. Unbounded whitespace lets a model that likes "\n" or " " run a JSON
# answer into its max_tokens (a known failure of constrained decoding); 16 still allows indented JSON.
MAX_JSON_WHITESPACE = 16


def constraint_key(spec: StructuredOutputsParams) -> str:
    """The cache key of a constraint: its kind and its canonical text."""
    value = spec.json_schema if spec.kind == "json" else getattr(spec, spec.kind)
    if isinstance(value, (dict, list)):
        value = json.dumps(value, sort_keys=True)
    return json.dumps([spec.kind, value, spec.disable_any_whitespace])


class GrammarCompiler:
    """Compiles constraints for one tokenizer, on one worker thread, with an LRU cache of the results."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], cache_size: int = CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's: padding rows)
        self._stop_token_ids = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-grammar",
                                        initializer=unbind_current_thread)
        self._xgr_compiler = None  # built on the worker thread by the first compile

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once when cached); its exception is an InvalidRequestError."""
        key = constraint_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar (blocks while it compiles); raises InvalidRequestError if it cannot."""
        return self.submit(spec).result()

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the worker thread ----------------------------------------------------------------------------

    def _compiler(self):
        if self._xgr_compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
            )
            # our LRU is the cache; xgrammar's own would keep every grammar ever compiled
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._xgr_compiler

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):  # json_object: OpenAI's "any JSON object"
                schema = spec.json_schema if kind == "json" else '{"type": "object"}'
                schema = schema if isinstance(schema, str) else json.dumps(schema)
                return compiler.compile_grammar(json_schema_grammar(schema, spec.disable_any_whitespace))
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if kind == "grammar":
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_structural_tag(spec.structural_tag)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types with the reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(
                f"The {kind} constraint cannot be compiled: {reason[:400]}", param="structured_outputs"
            ) from None


# xgrammar 0.2 writes a string with minLength/maxLength as `"\"" chars{m, n} "\""` with chars
# `[^\"\\\r\n]`, which lets raw control characters (U+0000-U+001F) into the string: invalid JSON that
# json.loads and pydantic refuse. Random weights find it within 50 requests. Its unbounded strings
# exclude them; so do ours.
_BOUNDED_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: str, compact: bool) -> str:
    """xgrammar's EBNF for a JSON schema (free whitespace up to MAX_JSON_WHITESPACE a gap unless `compact`),
    with length-bounded strings kept to valid JSON string characters."""
    import xgrammar as xgr

    whitespace = {"any_whitespace": False} if compact else {"max_whitespace_cnt": MAX_JSON_WHITESPACE}
    ebnf = str(xgr.Grammar.from_json_schema(schema, strict_mode=True, **whitespace))
    return ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
