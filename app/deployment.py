"""The Ray Serve deployments: LLMServer, one AsyncLLMEngine per replica with the OpenAI API as its HTTP app, and
in front of several of them OpenAIIngress, which lets the prefix-aware router see each request's prompt.

Each LLMServer replica asks for a placement group of tensor_parallel_size bundles (bundle 0 holds the replica,
which is rank 0; bundles 1..tp-1 hold the TP worker actors) packed on one node. `build_app(args)` is the
application for both the CLI and `serve run configs/serve.yaml`: LLMServer alone where it has one replica or
Serve's own router (HTTP goes from Serve's proxy straight to the replica), else OpenAIIngress -> LLMServer
(app/ingress.py; the ingress calls `LLMServer.answer_http`, answered by the same HTTP app). `build_replica_app`
is the HTTP app of one replica: the deployment serves it, and the tests and scripts that run a replica's app
without Serve build it the same way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.types import Message

from app.api import StreamBatching, build_api, engine_stats_dict
from app.autoscaling import QUEUE_DEPTH_METRIC, autoscaling_config
from app.config import ServeArgs
from app.direct_ingress import reuse_the_port_of_a_dead_replica
from app.drain import DrainGate, DrainState, ReplicaDrain
from app.engine_recovery import EngineRecovery
from app.errors import RETRY_AFTER_S
from app.forwarding import ForwardedRequest, answer_forwarded
from app.model_defaults import default_sampling, use_chat_template
from app.observability.replica import ReplicaObservability
from app.replica_device import deployment_wants_gpus, replica_device, replica_ray_actor_env
from app.routing.request import RoutedRequest
from app.routing.router import request_router_config
from app.routing.stats import engine_routing_stats
from app.routing.telemetry import LISTENER
from app.serving import OpenAIServing

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("shardserve.deployment")

DEMO_MODEL_NAME = "shardserve-demo"
RAY_METRICS_INTERVAL_S = 5.0  # how often a replica copies its Prometheus metrics into Ray's node export
# how often Serve's own drain of a stopping replica counts its ongoing requests (Serve's default, 2 s, is also
# the least time an idle replica takes to stop)
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2
INGRESS_CPUS = 0.1
# Serve's own threads in the ingress: its code, its handle's router and Serve's replica loop on one event loop,
# as Serve's throughput-optimized mode runs them (without that mode's direct HTTP ingress), instead of three
# threads handing every streamed message to each other (docs/BENCHMARKS.md "Routing across replicas")
INGRESS_SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# the engine replica's HTTP app (or its answer_http for the ingress) on Serve's own event loop too: by default Serve
# runs user code on a second loop in a thread of its own, and every request and streamed message then crosses
# between the two threads, each crossing a wake-up on the cores the engine computes on (docs/BENCHMARKS.md, "Serving
# path: one event loop in the replica, no idle proxy"). The engine steps on its own thread either way.
REPLICA_SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def served_model_name(args: ServeArgs) -> str:
    return args.served_model_name or args.model or DEMO_MODEL_NAME


def model_path(args: ServeArgs) -> str:
    """The model to load: --model, else the demo model (SmolLM2-135M-Instruct, fetched once into the cache)."""
    if args.model is not None:
        return args.model
    from engine.checkpoint.demo import ensure_demo_model

    return str(ensure_demo_model())


def build_replica_app(engine: AsyncLLMEngine, args: ServeArgs, observability: ReplicaObservability,
                      drain_state: DrainState | None = None) -> FastAPI:
    """One replica's HTTP app over its engine: the OpenAI routes with stream batching, /metrics and the trace
    context (`observability`, which takes every finished request's record), and the drain gate outermost."""
    use_chat_template(engine.tokenizer, args.chat_template)  # the engine loaded the replica's tokenizer
    defaults = default_sampling(args.model, args.generation_config, args.override_generation_config)
    serving = OpenAIServing(engine, served_model_name(args), args.max_waiting_requests, defaults,
                            on_request_finished=observability.record_request,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser)
    app = build_api(serving, StreamBatching(args.stream_interval_ms / 1000, args.max_stream_writes_per_s),
                    api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes)
    observability.install(app)
    app.add_middleware(DrainGate, state=drain_state if drain_state is not None else DrainState())
    return app


def _use_gpu(args: ServeArgs) -> bool:
    """Each rank asks Ray for a GPU: decided from the Ray cluster, not this process (app/replica_device.py)."""
    return deployment_wants_gpus(args)


def rank_accelerator(args: ServeArgs) -> dict[str, float]:
    """The accelerator one TP rank takes: --accelerator-resource, else a GPU where the replicas run on CUDA."""
    if args.accelerator_resource is not None:
        return {args.accelerator_resource: args.accelerator_per_rank}
    return {"GPU": args.accelerator_per_rank} if _use_gpu(args) else {}


def placement_group_bundles(args: ServeArgs) -> list[dict[str, float]]:
    """One bundle per TP rank: the rank's CPUs and its accelerator ({"GPU": 1} on GPU; none on CPU)."""
    bundle: dict[str, float] = {"CPU": args.cpus_per_rank, **rank_accelerator(args)}
    return [dict(bundle) for _ in range(args.tensor_parallel_size)]


def replica_actor_options(args: ServeArgs) -> dict[str, Any]:
    """Ray options of the replica process, rank 0: bundle 0's CPUs and accelerator."""
    options: dict[str, Any] = {"num_cpus": args.cpus_per_rank,
                               "runtime_env": {"env_vars": {**REPLICA_SERVE_ENV, **replica_ray_actor_env(args)}}}
    accelerator = rank_accelerator(args)
    if "GPU" in accelerator:
        options["num_gpus"] = accelerator.pop("GPU")
    if accelerator:  # a custom resource
        options["resources"] = accelerator
    return options


def max_ongoing_requests(args: ServeArgs) -> int:
    """Requests one replica accepts at once: its batch (max_num_seqs) plus a small waiting allowance.

    Serve's default (5) would cap the engine's batch at 5; far above the batch, the router pins every queued
    request to the first replica before a second one exists, and autoscaling then has nothing to move.
    """
    if args.max_ongoing_requests is not None:
        return args.max_ongoing_requests
    return args.max_num_seqs + max(2, args.max_num_seqs // 8)


def deployment_options(args: ServeArgs) -> dict[str, Any]:
    """Ray Serve deployment options derived from the settings (replicas, placement, concurrency)."""
    options: dict[str, Any] = {
        "name": "LLMServer",
        "max_ongoing_requests": max_ongoing_requests(args),
        # The router's queue is bounded too; past it, Serve answers 429 with Retry-After.
        "max_queued_requests": max(1, args.max_waiting_requests),
        "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_S},
        # Serve's own drain (scale-down, `serve run`): ongoing requests get --shutdown-timeout, as with the CLI
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        "ray_actor_options": replica_actor_options(args),
        "placement_group_bundles": placement_group_bundles(args),
        "placement_group_strategy": args.placement_group_strategy,
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
    }
    routing = args.routing_config()
    if routing is not None:  # called through the ingress, whose process holds the router and its telemetry
        options["request_router_config"] = request_router_config(routing, listener=LISTENER)
    if args.num_replicas is not None:
        options["num_replicas"] = args.num_replicas
    elif args.min_replicas == args.max_replicas:
        # nothing to scale (the default, 1 and 1): with an autoscaling config each replica would still record its
        # queue depth and push it to Serve's controller every METRICS_INTERVAL_S, and the controller would run the
        # policy on it, for nothing; served at concurrency 50 that cost 1.6-3.6% (docs/BENCHMARKS.md, "Serving
        # path: one event loop in the replica, no idle proxy")
        options["num_replicas"] = args.min_replicas
    else:
        options["autoscaling_config"] = autoscaling_config(
            args.min_replicas, args.max_replicas, args.target_queue_depth, args.upscale_delay_s,
            args.downscale_delay_s)
    return options


class LLMServer:
    """One engine replica: its HTTP app (for Serve's proxy, or the ingress through answer_http) and the methods
    handles call. Deployed as HTTP_LLM_SERVER or, behind the ingress, ROUTED_LLM_SERVER (below)."""

    def __init__(self, args: dict[str, Any]):
        from engine import AsyncLLMEngine  # imported here: loading torch is the replica's business

        _configure_logging()
        _keep_replica_grpc_on_loopback()
        reuse_the_port_of_a_dead_replica()  # where this replica answers HTTP itself (app/direct_ingress.py)
        self.args = ServeArgs.model_validate(args)
        # auto is decided here, where the replica runs, from the GPU Ray reserved for it (or not)
        self.args = self.args.model_copy(update={"device": replica_device(self.args)})
        model_dir = model_path(self.args)
        # open HTTP requests, and graceful shutdown under the CLI (app/drain.py; without the CLI's drain board,
        # `drain` is None)
        self.drain_state = DrainState()
        # deltas reach the event loop as often as a stream may write (stream batching), not after every step
        # an engine that dies is rebuilt in this process, or the process exits (app/engine_recovery.py)
        self.recovery = EngineRecovery(self.drain_state)
        self.engine = AsyncLLMEngine(self.args.engine_config(model_dir),
                                     on_dead=self.recovery.engine_died,
                                     delivery_interval_s=self.args.stream_interval_ms / 1000)
        self.recovery.attach(self.engine)
        self.drain = ReplicaDrain.attach(_app_name(), _replica_id(), self.drain_state, self.engine.abort_all)
        # tracing and /metrics: one TracerProvider and one Prometheus registry per replica (app/observability/)
        self.observability = ReplicaObservability(self.engine, served_model_name(self.args), _replica_id(),
                                                  self.args.tensor_parallel_size, self.args.otlp_traces_endpoint,
                                                  ray_metrics_interval_s=RAY_METRICS_INTERVAL_S)
        # one app for both paths: Serve's proxy calls it directly, the ingress through answer_http
        self.http_app = build_replica_app(self.engine, self.args, self.observability, self.drain_state)
        logger.info("replica ready: model %s served as %r", model_dir, served_model_name(self.args))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.http_app

    async def answer_http(self, routed: RoutedRequest, request: ForwardedRequest) -> AsyncIterator[Message]:
        """An HTTP request the ingress sent on (app/ingress.py; `routed` was the router's), answered by this
        replica's own HTTP app: its ASGI messages, as they come."""
        async for message in answer_forwarded(self.http_app, request):
            yield message

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue depth for app/autoscaling.py: sequences waiting plus running in this replica's engine."""
        stats = self.engine.stats()
        return {QUEUE_DEPTH_METRIC: float(stats.num_waiting + stats.num_running)}

    def record_routing_stats(self) -> dict[str, float]:
        """This replica's load for the request router (app/routing/stats.py): queue depth and KV-cache use."""
        return engine_routing_stats(self.engine.stats())

    def engine_stats(self) -> dict[str, Any]:
        """This replica's EngineStats as a dict (for observability and tests)."""
        return engine_stats_dict(self.engine)

    def process_rss_bytes(self) -> int:
        """This replica process's resident memory (for the reliability suite's memory bounds)."""
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def check_health(self) -> None:
        """Serve's health check: fails while the engine is dead and not being rebuilt, so Serve replaces this
        replica (which exits by itself where it does not rebuild: app/engine_recovery.py), and while the engine's
        loop is stuck on a rank Ray reported lost (it would never mark the engine dead)."""
        if not self.engine.is_running and not self.recovery.rebuilding():
            raise RuntimeError(f"the engine is not running: {self.engine.dead_reason}")
        stuck = self.engine.unnoticed_rank_loss()
        if stuck is not None:
            raise RuntimeError(f"the engine loop is stuck: {stuck}")

    def __del__(self):
        drain = getattr(self, "drain", None)
        if drain is not None:
            drain.detach()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        observability = getattr(self, "observability", None)
        if observability is not None:
            observability.shutdown()


# Serve allows one ASGI app per application: the replicas' own is Serve's HTTP entry only without the ingress
HTTP_LLM_SERVER = serve.deployment(serve.ingress()(LLMServer))
ROUTED_LLM_SERVER = serve.deployment(LLMServer)


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP front of several LLMServer replicas (app/ingress.py): routes each request by its prompt."""

    def __init__(self, args: dict[str, Any], engine: DeploymentHandle):
        # imported here, TELEMETRY included: Serve pickles this class by value, and TELEMETRY's lock cannot be
        from app.ingress import IngressApp, IngressSettings, ReplicaCall
        from app.observability.metrics import RayMetricsMirror
        from app.observability.routing import IngressMetrics
        from app.observability.tracing import TRACER_NAME, make_tracer_provider
        from app.routing.telemetry import TELEMETRY
        from engine.checkpoint.loader import load_tokenizer

        _configure_logging()
        _keep_replica_grpc_on_loopback()
        reuse_the_port_of_a_dead_replica()  # where this replica answers HTTP itself (app/direct_ingress.py)
        self.args = ServeArgs.model_validate(args)
        name = served_model_name(self.args)
        self.metrics = IngressMetrics(TELEMETRY, name)
        self.ray_mirror = RayMetricsMirror(self.metrics.registry, RAY_METRICS_INTERVAL_S)
        self.tracer_provider = make_tracer_provider(self.args.otlp_traces_endpoint,
                                                    {"shardserve.replica_id": _replica_id()})
        tracer = self.tracer_provider.get_tracer(TRACER_NAME) if self.tracer_provider is not None else None
        settings = IngressSettings(self.args.block_size, self.args.max_request_body_bytes, self.args.api_key)
        # gRPC between the ingress and the replicas, not object references: fewer copies per streamed message
        call = ReplicaCall(engine.options(stream=True, method_name="answer_http", _by_reference=False))
        tokenizer = load_tokenizer(model_path(self.args))
        use_chat_template(tokenizer, self.args.chat_template)  # the replicas' prompts, so the same block hashes
        self.http_app = IngressApp(call, tokenizer, settings, TELEMETRY, self.metrics, tracer)
        logger.info("ingress ready: routing %r over LLMServer replicas (%s)", name, self.args.routing)

    def __serve_build_asgi_app__(self):
        return self.http_app

    def __del__(self):
        ray_mirror = getattr(self, "ray_mirror", None)
        if ray_mirror is not None:
            ray_mirror.stop()
        tracer_provider = getattr(self, "tracer_provider", None)
        if tracer_provider is not None:
            tracer_provider.shutdown()


def ingress_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the ingress: a pass-through that takes every request its engine replicas could hold."""
    engine_replicas = args.num_replicas or args.max_replicas
    capacity = engine_replicas * (max_ongoing_requests(args) + args.max_waiting_requests)
    return {
        "name": "OpenAIIngress",
        "num_replicas": args.ingress_replicas,
        "max_ongoing_requests": max(1, capacity // args.ingress_replicas),
        # it tokenizes and relays: a tenth of a core, which also keeps it off a Ray head started with no CPUs
        # (a KubeRay head holds no model files to read the tokenizer from)
        "ray_actor_options": {"num_cpus": INGRESS_CPUS, "runtime_env": {"env_vars": INGRESS_SERVE_ENV}},
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    }


def build_app(args: ServeArgs, ingress: bool | None = None) -> Application:
    """The Serve application for these settings (`serve run app.deployment:build_app` passes a dict). `ingress`:
    put the ingress in front (default: where the request router serves, ServeArgs.routing_config); True is
    for measuring its hop with one replica (scripts/bench_routing.py)."""
    if not isinstance(args, ServeArgs):
        args = ServeArgs.model_validate(args)
    if not (ingress if ingress is not None else args.routing_config() is not None):
        return HTTP_LLM_SERVER.options(**deployment_options(args)).bind(args.model_dump())
    engine = ROUTED_LLM_SERVER.options(**deployment_options(args)).bind(args.model_dump())
    return OpenAIIngress.options(**ingress_options(args)).bind(args.model_dump(), engine)


def _replica_id() -> str:
    """This replica's id as Serve names it (label `replica` of /metrics, attribute of every span)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (local testing mode)
        return "local"


def _app_name() -> str:
    """The Serve application this replica belongs to (its drain board is named after it)."""
    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - outside a Serve replica (local testing mode)
        return "local"


def _keep_replica_grpc_on_loopback() -> None:
    """Ray Serve 2.60 starts each replica's inter-deployment gRPC server on "[::]:0" (every interface) even
    when Ray itself is loopback-only. On a loopback-only node, bind it to 127.0.0.1 like every other Ray port.
    This runs in the constructor, before Serve starts that server."""
    import ray
    from ray.serve._private import replica as serve_replica

    if ray.util.get_node_ip_address() != "127.0.0.1" or not hasattr(serve_replica, "add_port_to_grpc_server"):
        return
    add_port = serve_replica.add_port_to_grpc_server
    if getattr(add_port, "_shardserve_loopback", False):
        return

    def add_port_on_loopback(server, address: str):
        return add_port(server, address.replace("[::]", "127.0.0.1"))

    add_port_on_loopback._shardserve_loopback = True
    serve_replica.add_port_to_grpc_server = add_port_on_loopback


def _configure_logging() -> None:
    log = logging.getLogger("shardserve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
