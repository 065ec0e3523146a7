"""When a sequence ends: after each new token, the scheduler asks `StopChecker` whether that token stops it."""

from __future__ import annotations

from engine.detokenizer import Detokenizer
from engine.sequence import Sequence

# (finish_reason, stop_reason): ("stop", a stop token id, a stop string or None for EOS), or ("length", None)
Stop = tuple[str, str | int | None]


class StopChecker:
    """The rules, in order: a requested stop token, then EOS (unless ignored), both only after min_tokens;
    then a stop string in the detokenized text; then max_tokens or the context length."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, detokenizer: Detokenizer | None):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.detokenizer = detokenizer  # None: no text is kept, so no stop strings (scheduler tests)

    def check(self, seq: Sequence, token_id: int) -> Stop | None:
        """Whether `token_id`, just appended to `seq`, ends it (the detokenizer's text grows here too)."""
        params = seq.sampling_params
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token_id in params.stop_token_ids:
            return "stop", token_id
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop", None
        stop_string = self.detokenizer.append_token(seq) if self.detokenizer is not None else None
        if stop_string is not None and may_stop:
            return "stop", stop_string
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None
