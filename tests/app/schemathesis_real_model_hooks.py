"""schemathesis hooks for a run against a real model (SCHEMATHESIS_HOOKS=tests.app.schemathesis_real_model_hooks).

A generated request may ask for 128 choices of the whole context, which is minutes of CPU for one case.
These hooks cap the work a request asks for and leave its shape as generated.
"""

from __future__ import annotations

import schemathesis

MAX_TOKENS = 8
MAX_CHOICES = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if _is_int(body.get(key)) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if "messages" in body and not any(_is_int(body.get(k)) for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
    if _is_int(body.get("n")) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES
    return body
