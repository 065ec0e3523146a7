"""RoutedRequest: what the ingress passes as the first positional argument of an engine handle call.

The router reads it from `PendingRequest.args[0]` to route by prompt prefix; the replica method receives it
too and may ignore it. It carries the prompt's chained block hashes (app/routing/block_hashes.py), computed
once in the ingress where the prompt is tokenized, so that no router hashes or even sees token ids, and the
ingress's own id for the request, which the router's decision carries back (app/routing/telemetry.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutedRequest:
    """The routing key of one request: the engine's hashes of its prompt's full blocks, first block first."""

    block_hashes: tuple[bytes, ...] = ()
    request_id: str = ""  # the ingress's id of the request ("": the decision takes Serve's request id)
    avoid: tuple[str, ...] = ()  # replicas (Serve's unique_id) that lost this request before: ranked last
