"""`shardserve serve | bench | make-model`: the console script.

`serve` flags are generated from ServeArgs with vLLM's spelling (`--max-num-seqs`, `--no-enable-prefix-caching`).
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

from app.config import ServeArgs
from bench.flags import flag_help

logger = logging.getLogger("shardserve.cli")

APP_NAME = "shardserve"
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
    return ServeArgs(**fields)


def _cluster_cpus(args: ServeArgs) -> int:
    """Logical CPUs for the local Ray: enough for every replica's placement group at max scale."""
    replicas = args.num_replicas or args.max_replicas
    needed = replicas * args.tensor_parallel_size * args.cpus_per_rank + 1
    return max(os.cpu_count() or 1, int(needed + 0.999))


def serve(args: ServeArgs) -> None:
    """Start a local Ray, run the app behind Serve's HTTP proxy, block until Ctrl-C or SIGTERM."""
    from app.proxy_errors import use_openai_errors_in_serve_proxy

    # Set before Ray starts: every Ray port then listens on 127.0.0.1 only.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    use_openai_errors_in_serve_proxy()  # and Serve's own 429 and 503 come in OpenAI's shape
    import ray
    from ray import serve as ray_serve

    from app.deployment import build_app, served_model_name
    from app.drain import drain_application, start_coordinator

    scope = "this machine only" if args.host in ("127.0.0.1", "localhost", "::1") else "reachable from other machines"
    logger.info("binding HTTP to %s:%d (%s); Ray ports listen on 127.0.0.1 only", args.host, args.port, scope)
    # address="local": always a fresh cluster of our own, never one some other process started
    ray.init(address="local", include_dashboard=False, num_cpus=_cluster_cpus(args), logging_level=logging.WARNING)
    stop, hurry = threading.Event(), threading.Event()  # the first signal drains, a second one stops at once

    def on_signal(*_) -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(sig, on_signal)
    try:
        coordinator = start_coordinator(APP_NAME)  # before the replicas start: they look it up (app/drain.py)
        ray_serve.start(http_options={"host": args.host, "port": args.port})
        ray_serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        logger.info("serving %r at http://%s:%d/v1 (Ctrl-C to stop)", served_model_name(args), args.host, args.port)
        stop.wait()
        began = time.monotonic()
        logger.info("draining: new requests get 503, in-flight ones have %.0f s (Ctrl-C again to stop now)",
                    args.shutdown_timeout)
        pending = drain_application(coordinator, args.shutdown_timeout, hurry)
        logger.info("drained in %.1f s%s; shutting down", time.monotonic() - began,
                    f" ({len(pending)} replica(s) did not report)" if pending else "")
    finally:
        ray_serve.shutdown()
        ray.shutdown()


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
    add_serve_flags(serve_parser)
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
        serve(serve_args_from(namespace))
        return 0
    handler = getattr(namespace, "func", None)
    if handler is None:
        raise SystemExit(f"unknown command {namespace.command!r}")
    result = handler(namespace)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
