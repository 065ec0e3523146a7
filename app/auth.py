"""The API key check (--api-key), shared by a replica's routes (app/api.py) and the ingress (app/ingress.py)."""

from __future__ import annotations

import hmac


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an `Authorization` header's value is `Bearer <api_key>`."""
    scheme, _, key = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode())
