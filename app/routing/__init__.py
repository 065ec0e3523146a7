"""Prefix-aware, load-aware request routing across engine replicas (issue 17).

config (RoutingConfig), request (RoutedRequest, what the ingress passes), block_hashes (the prompt's
chained block hashes, as the engine names them), stats (what replicas report and the load compared),
prefix_index (the router's memory of prefixes sent), router (PrefixAwareRouter, Serve's RequestRouter),
telemetry (what the router tells the ingress: decisions and the replicas' reports). The ingress that builds
RoutedRequests is app/ingress.py.
The router module imports Ray Serve; import it from app.routing.router, not from here.
"""

from app.routing.config import RoutingConfig
from app.routing.request import RoutedRequest

__all__ = ["RoutingConfig", "RoutedRequest"]
