"""Incremental detokenization and stop strings.

Each new token is decoded inside a short window of the tokens before it (as vLLM does), so
the cost per token stays constant and characters whose UTF-8 bytes span several tokens are
emitted only once they are complete. A stop string ends the sequence and is not emitted; while
streaming, the last few characters are held back in case they begin a stop string.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import tokenizers

from engine.sequence import Sequence

_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to


def rust_decode(tokenizer):
    """The Rust tokenizer's own `decode` where it returns exactly what `tokenizer.decode` does: a transformers
    fast tokenizer that does not clean up tokenization spaces (transformers then returns the Rust decode as it
    is). It skips transformers' Python around each call, which was most of the cost of a token's detokenization
    (two decodes a token: about 20 us of which 3 us in Rust, a decode step at batch 96 spending 1.5-2 ms here).
    None for any other tokenizer."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    return backend.decode


# Texts on which rust_encode's encoder must give transformers' own ids before it stands in for `tokenizer.encode`:
# spaces, newlines and tabs, non-ASCII, digits, code, and (added per tokenizer) its special tokens' text
_ENCODE_PROBES = ("", "Hello world", " a leading space", "  two spaces\nnew line\ttab  ", "na\u00efve caf\u00e9 \u2014 "
                  "\u201cquotes\u201d \u65e5\u672c\u8a9e \U0001f642", "1234567890 3.14159 1e-5",
                  "def f(x):\n    return x**2  # squared\n", "x" * 300)
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rust_encode(tokenizer) -> Callable[[str], list[int]]:
    """`tokenizer.encode(text)` (special tokens added as the tokenizer adds them), through the Rust tokenizer's own
    `encode` where that gives the same ids on every probe text and the Rust tokenizer has no truncation or padding
    set: transformers' Python around it took ~4x the Rust call (a 512-token prompt: 3.0 ms against 0.67, the bench
    model's tokenizer), on the serving loop of every request with a text prompt. Made once per tokenizer."""
    try:
        return _ENCODERS[tokenizer]
    except (KeyError, TypeError):
        pass
    encode = _make_rust_encode(tokenizer)
    try:
        _ENCODERS[tokenizer] = encode
    except TypeError:  # not weakly referable: made again next time
        pass
    return encode


def _make_rust_encode(tokenizer) -> Callable[[str], list[int]]:
    def slow(text: str) -> list[int]:
        return list(tokenizer.encode(text))

    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer) or backend.truncation is not None or backend.padding is not None:
        return slow

    def fast(text: str) -> list[int]:
        return backend.encode(text).ids

    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if isinstance(t, str)]
    probes = (*_ENCODE_PROBES, " ".join(specials), f"{''.join(specials)} after")
    try:
        same = all(fast(text) == slow(text) for text in probes)
    except Exception:  # any failure of either: keep transformers' own
        same = False
    return fast if same else slow


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._rust_decode = rust_decode(tokenizer)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def append_token(self, seq: Sequence) -> str | None:
        """Extend `seq.text` with its newest token; returns the stop string it now contains, if any."""
        skip = seq.sampling_params.skip_special_tokens
        window = seq.token_ids[seq.prefix_offset :]
        prefix_text = self.decode(seq.token_ids[seq.prefix_offset : seq.read_offset], skip)
        full_text = self.decode(window, skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return None  # wait for the rest of a multi-byte character (or a token with no text)
        new_text = full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = seq.num_tokens
        start = len(seq.text)
        seq.text += new_text
        return self._find_stop(seq, start)

    @staticmethod
    def _find_stop(seq: Sequence, new_text_start: int) -> str | None:
        stops = seq.sampling_params.stop
        if not stops:
            return None
        best = None
        for stop in stops:
            # a stop string may begin in earlier text and end in the new piece
            idx = seq.text.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        seq.text = seq.text[: best[0]]
        return best[1]

    @staticmethod
    def take_new_text(seq: Sequence) -> str:
        """Text not yet emitted, holding back a possible stop-string prefix unless finished."""
        end = len(seq.text)
        stops = seq.sampling_params.stop
        if stops and not seq.is_finished:
            end = max(seq.num_emitted_chars, end - (max(len(s) for s in stops) - 1))
        new = seq.text[seq.num_emitted_chars : end]
        seq.num_emitted_chars = end
        return new
