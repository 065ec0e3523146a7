"""`shardserve serve | prepare-node | bench | make-model`: the console script.

`serve` flags are generated from ServeArgs with vLLM's spelling (`--max-num-seqs`, `--no-enable-prefix-caching`);
`prepare-node` takes the same ones (app/prepare_node.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import types
import typing
from typing import Any

from pydantic import ValidationError

from app.config import ServeArgs
from app.control_plane import apply_control_plane
from app.cpu_placement import keep_control_plane_off_compute_cores, plan_cpu_threads_bind
from app.direct_ingress import (
    CONTROLLER_CALLBACK_ENV,
    NO_HEAD_PROXY,
    direct_ingress_env,
    resolve_http_ingress,
)
from app.ray_cluster import (
    adopt_orphaned_descendants,
    end_leftover_processes,
    local_cluster_alive,
    ray_processes_in_their_own_process_group,
)
from bench.flags import flag_help

logger = logging.getLogger("shardserve.cli")

APP_NAME = "shardserve"
# Serve's shutdown after the drain (replicas stop, the proxy goes): about 1 s idle on 2 cores; past this bound
# the cluster is not answering, and ray.shutdown() ends it
SERVE_SHUTDOWN_TIMEOUT_S = 10.0
# what is left of a local cluster whose own processes were signalled: a moment to exit before SIGKILL
GONE_CLUSTER_GRACE_S = 0.5
# Flags vLLM users expect that are spelled differently in ServeArgs.
FLAG_ALIASES = {"tensor_parallel_size": ["-tp"]}


def _flag_type(annotation: Any) -> tuple[Any, list | None]:
    """(argparse type, choices) for one ServeArgs field annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        choices = list(typing.get_args(annotation))
        return type(choices[0]), choices
    if typing.get_origin(annotation) is dict:
        return json.loads, None  # a JSON object; ServeArgs checks its keys
    return annotation, None


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeArgs field; unset flags stay out of the namespace so ServeArgs' defaults apply."""
    for name, field in ServeArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = flag_help(field)
        kind, choices = _flag_type(field.annotation)
        names = [flag, *FLAG_ALIASES.get(name, [])]
        if kind is bool:
            parser.add_argument(*names, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(*names, dest=name, type=kind, choices=choices, default=argparse.SUPPRESS,
                                help=help_text)


def serve_args_from(namespace: argparse.Namespace) -> ServeArgs:
    """The settings of `shardserve serve [MODEL] --flags`: MODEL is --model (vLLM's `vllm serve MODEL`)."""
    fields = {k: v for k, v in vars(namespace).items() if k in ServeArgs.model_fields}
    model_tag = getattr(namespace, "model_tag", None)
    if model_tag is not None:
        if fields.get("model", model_tag) != model_tag:
            raise SystemExit(f"shardserve serve: the model is given twice, as {model_tag!r} and as --model "
                             f"{fields['model']!r}: give it once")
        fields["model"] = model_tag
    try:
        return ServeArgs(**fields)
    except ValidationError as e:  # a flag's value the settings refuse: its name and why, not a traceback
        error = e.errors()[0]
        field, *inside = [str(part) for part in error["loc"] if part != "[key]"] or [""]
        where = ("--" + field.replace("_", "-") + "".join(f" {part!r}" for part in inside) + ": ") if field else ""
        raise SystemExit(f"shardserve serve: {where}{error['msg'].removeprefix('Value error, ')}") from None


def _cluster_cpus(args: ServeArgs) -> int:
    """Logical CPUs for the local Ray: enough for every replica's placement group at max scale."""
    replicas = args.num_replicas or args.max_replicas
    needed = replicas * args.tensor_parallel_size * args.cpus_per_rank + 1
    return max(os.cpu_count() or 1, int(needed + 0.999))


def connect_to_ray(args: ServeArgs, ray_address: str | None) -> bool:
    """Join the cluster at `ray_address` (an address, or `auto`: the one `ray start` left on this machine), or
    start a local one of our own; True where it is our own (we stop it on leaving)."""
    import ray

    if ray_address is not None:
        ray.init(address=ray_address, logging_level=logging.WARNING)
        return False
    ray_processes_in_their_own_process_group()  # a signal to our process group reaches the CLI only
    adopt_orphaned_descendants()
    # address="local": always a fresh cluster of our own, never one some other process started
    ray.init(address="local", include_dashboard=False, num_cpus=_cluster_cpus(args), logging_level=logging.WARNING)
    return True


def _is_loopback(ray_address: str) -> bool:
    """Whether a Ray address (host:port, or ray://host:port) names this machine's loopback interface."""
    host = ray_address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def finishes_within(timeout_s: float, step) -> bool:
    """Run `step` on a daemon thread; False if it has not returned within timeout_s (it is then left behind)."""
    thread = threading.Thread(target=step, name="shardserve-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def serve(args: ServeArgs, ray_address: str | None = None) -> None:
    """Run the app on Ray Serve behind its HTTP proxy, on the cluster at `ray_address` or on a local one of our
    own; block until Ctrl-C or SIGTERM, then drain."""
    from app.proxy_errors import use_openai_errors_in_serve_proxy

    ray_on_loopback = ray_address is None or ray_address == "auto" or _is_loopback(ray_address)
    if ray_on_loopback:  # set before Ray starts: every Ray port then listens on 127.0.0.1 only
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    use_openai_errors_in_serve_proxy()  # and Serve's own 429 and 503 come in OpenAI's shape
    try:
        ingress = resolve_http_ingress(args, own_cluster=ray_address is None)
    except ValueError as e:
        raise SystemExit(f"shardserve serve: {e}") from None
    proxy_port = args.port
    # "auto" resolved for this machine (our own Ray) or for several replicas (app/cpu_placement.py)
    args = plan_cpu_threads_bind(args, own_cluster=ray_address is None)
    if ray_address is None:  # our own Ray: its processes start with the profile's periods, off the compute cores
        apply_control_plane(args.control_plane)
        keep_control_plane_off_compute_cores(args)
    if ingress == "direct":  # set before Ray starts, as the proxy's middleware is: Serve reads them at import
        os.environ.update(direct_ingress_env(args.port))
        # and no Serve proxy on the head node, unless the operator has a controller callback of their own
        os.environ.setdefault(CONTROLLER_CALLBACK_ENV, NO_HEAD_PROXY)
        proxy_port = 0  # a head proxy (an operator's own callback keeps it) off the replica's port: one the system picks
    from ray import serve as ray_serve

    from app.deployment import build_app, served_model_name
    from app.drain import ClusterGone, drain_application, open_board

    scope = "this machine only" if args.host in ("127.0.0.1", "localhost", "::1") else "reachable from other machines"
    ray_scope = ("Ray ports listen on 127.0.0.1 only" if ray_on_loopback else
                 f"Ray talks on this machine's address, to the cluster at {ray_address}")
    logger.info("binding HTTP to %s:%d (%s); %s answers it; %s", args.host, args.port, scope,
                "the ingress replica itself (direct ingress)" if ingress == "direct" else "Serve's proxy", ray_scope)
    own_cluster = connect_to_ray(args, ray_address)
    stop, hurry = threading.Event(), threading.Event()  # the first signal drains, a second one stops at once
    cluster_gone = False

    def on_signal(*_) -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(sig, on_signal)
    try:
        board = open_board(APP_NAME)  # before the replicas start: they look for it (app/drain.py)
        # the proxy on the head node only, as configs/serve.yaml has it: worker nodes hold replicas
        ray_serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": proxy_port})
        failed: list[BaseException] = []

        def deploy() -> None:
            try:
                ray_serve.run(build_app(args), name=APP_NAME, route_prefix="/")
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                failed.append(e)
                stop.set()
                return
            logger.info("serving %r at http://%s:%d/v1 (Ctrl-C to stop)", served_model_name(args), args.host,
                        args.port)

        # on a thread: a signal while the replicas start stops at once, even when Ray has gone and serve.run,
        # waiting for the application, would never return
        threading.Thread(target=deploy, name="shardserve-deploy", daemon=True).start()
        stop.wait()
        if failed:
            raise failed[0]
        began = time.monotonic()
        logger.info("draining: new requests get 503, in-flight ones have %.0f s (Ctrl-C again to stop now)",
                    args.shutdown_timeout)
        try:
            pending = drain_application(board, APP_NAME, args.shutdown_timeout, hurry,
                                        local_cluster_alive if own_cluster else lambda: True)
        except ClusterGone as gone:
            logger.warning("the Ray cluster is gone (%s): not waiting for replicas", gone)
            cluster_gone = True
        else:
            logger.info("drained in %.1f s%s; shutting down", time.monotonic() - began,
                        f" ({len(pending)} replica(s) did not report)" if pending else "")
    finally:
        leave_ray(own_cluster, cluster_gone)


def leave_ray(own_cluster: bool, cluster_gone: bool = False) -> None:
    """Stop serving: our own cluster goes with everything on it; on a cluster we joined, only our application."""
    import ray
    from ray import serve as ray_serve

    if cluster_gone or (own_cluster and not local_cluster_alive()):
        # its processes were signalled too (systemd's control-group stop): Serve's graceful shutdown would wait
        # on a controller that cannot answer, and ray.shutdown() a second on each process still exiting
        logger.warning("stopping without Serve's shutdown: the Ray cluster is gone")
        if own_cluster:
            end_leftover_processes(grace_s=GONE_CLUSTER_GRACE_S)
            # ray.shutdown(), here or at exit, would wait 5 s for a GCS and a raylet that have gone
            logging.shutdown()
            os._exit(0)
    elif not finishes_within(SERVE_SHUTDOWN_TIMEOUT_S, ray_serve.shutdown if own_cluster else
                             lambda: ray_serve.delete(APP_NAME)):
        logger.warning("Serve did not shut down within %.0f s; stopping without it", SERVE_SHUTDOWN_TIMEOUT_S)
    ray.shutdown()
    if own_cluster and (left := end_leftover_processes()):
        logger.warning("ended %d process(es) that outlived ray.shutdown(): %s", len(left), left)


def _missing_bench_extra() -> str | None:
    """Why `shardserve bench` cannot run here, or None: the bench package and its packages are the bench extra."""
    try:
        import bench.cli  # noqa: F401
    except ModuleNotFoundError as missing:  # the server image installs shardserve[serve] only
        return f"shardserve bench needs the bench extra: pip install 'shardserve[bench]' ({missing})"
    return None


def _add_bench(subparsers) -> None:
    if reason := _missing_bench_extra():
        subparsers.add_parser("bench", help=reason)  # listed; main() stops with the reason before parsing bench flags
        return
    from bench.cli import add_parser

    add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardserve", description="An OpenAI-compatible LLM server.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    serve_parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve_parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                              help="the model to serve, as vLLM takes it: the same as --model")
    serve_parser.add_argument("--ray-address", default=None, metavar="ADDR", help=(
        "join the running Ray cluster at ADDR (host:port of its GCS, or auto: the one `ray start` left on this "
        "machine) instead of starting a local one; the application is deleted from it on exit. With auto or a "
        "127.0.0.1 address Ray stays on loopback; with another host it talks on this machine's address"))
    add_serve_flags(serve_parser)
    prepare = subparsers.add_parser("prepare-node", help=(
        "before Ray starts on a node: resolve the model that replicas there will load and unpack a GGUF file "
        "into this node's cache (idempotent); takes serve's flags, of which the model, --dtype and --device "
        "matter"))
    prepare.add_argument("model_tag", nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                         help="the model, as serve takes it: the same as --model")
    add_serve_flags(prepare)
    make_model = subparsers.add_parser("make-model", help="write a small random-weight model directory",
                                       add_help=False)
    make_model.add_argument("make_model_args", nargs=argparse.REMAINDER)
    _add_bench(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-model"]:  # its own parser owns the flags (--arch, --preset, --out)
        from engine.checkpoint.random_model import main as make_model_main

        make_model_main(argv[1:])
        return 0
    if argv[:1] == ["bench"] and (reason := _missing_bench_extra()):
        raise SystemExit(reason)
    namespace = build_parser().parse_args(argv)
    if namespace.command == "serve":
        serve(serve_args_from(namespace), namespace.ray_address)
        return 0
    if namespace.command == "prepare-node":
        from app.prepare_node import prepare_node
        from engine.errors import ModelLoadError

        try:
            print(prepare_node(serve_args_from(namespace)).describe())
        except ModelLoadError as e:  # the node cannot hold a replica: its init step fails, with what to fix
            raise SystemExit(f"shardserve prepare-node: {e}") from None
        return 0
    handler = getattr(namespace, "func", None)
    if handler is None:
        raise SystemExit(f"unknown command {namespace.command!r}")
    result = handler(namespace)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
