"""configs/serve.yaml, the CLI and build_app describe one application (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from app.autoscaling import METRICS_INTERVAL_S, QUEUE_DEPTH_METRIC, QueueDepthPolicy
from app.cli import build_parser, serve_args_from
from app.config import ServeArgs
from app.deployment import (
    REPLICA_SERVE_ENV,
    build_app,
    deployment_options,
    max_ongoing_requests,
    placement_group_bundles,
)
from engine.config import EngineConfig

SERVE_YAML = Path(__file__).resolve().parents[2] / "configs" / "serve.yaml"


def cli_args(*flags: str) -> ServeArgs:
    return serve_args_from(build_parser().parse_args(["serve", *flags]))


def test_serve_yaml_is_a_valid_serve_config_of_the_cli_default_app():
    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_YAML.read_text()))
    [application] = config.applications
    assert application.import_path == "app.deployment:build_app"
    args = ServeArgs.model_validate(application.args)
    assert args.model_dump() == cli_args().model_dump()
    assert (config.http_options.host, config.http_options.port) == (args.host, args.port) == ("127.0.0.1", 8000)


def test_cli_flags_use_vllm_spelling():
    args = cli_args("--model", "/m", "--tensor-parallel-size", "2", "--max-num-seqs", "4", "--max-model-len", "128",
                    "--enable-prefix-caching", "--served-model-name", "x", "--api-key", "k", "--port", "9000",
                    "--min-replicas", "1", "--max-replicas", "3", "--target-queue-depth", "5",
                    "--max-waiting-requests", "7", "--dtype", "float32")
    assert (args.model, args.tensor_parallel_size, args.max_num_seqs, args.max_model_len) == ("/m", 2, 4, 128)
    assert args.enable_prefix_caching and args.served_model_name == "x" and args.api_key == "k"
    assert (args.port, args.min_replicas, args.max_replicas, args.target_queue_depth) == (9000, 1, 3, 5.0)
    assert args.max_waiting_requests == 7 and args.dtype == "float32"
    assert not cli_args("--no-enable-prefix-caching").enable_prefix_caching
    assert cli_args().host == "127.0.0.1"
    with pytest.raises(SystemExit):
        cli_args("--dtype", "float64")


def test_a_flag_value_the_settings_refuse_is_named_with_the_reason_not_a_traceback():
    with pytest.raises(SystemExit, match="^shardserve serve: cpu_threads_bind '3-1': the range '3-1' runs backwards$"):
        cli_args("--cpu-threads-bind", "3-1")
    with pytest.raises(SystemExit, match="^shardserve serve: --max-num-seqs: Input should be greater than or equal to 1$"):
        cli_args("--max-num-seqs", "0")


def test_the_model_may_come_first_as_vllm_serve_takes_it():
    assert cli_args("/models/x", "--port", "9000").model == "/models/x"
    assert cli_args("--port", "9000", "/models/x").model == "/models/x"
    assert cli_args("/models/x", "--model", "/models/x").model == "/models/x"
    assert cli_args().model is None  # the demo model
    with pytest.raises(SystemExit, match="given twice"):
        cli_args("/models/x", "--model", "/models/y")


@pytest.mark.parametrize("block_size", [24, 512])
def test_serve_args_refuse_a_block_size_the_engine_refuses(block_size):
    with pytest.raises(ValidationError):
        EngineConfig(model="m", block_size=block_size)
    with pytest.raises(ValidationError, match="block_size|less than or equal to 256"):
        ServeArgs(block_size=block_size)
    with pytest.raises(SystemExit, match="^shardserve serve: (--block-size: )?block_size must be a power of two"
                                         "|^shardserve serve: --block-size: Input should be less than or equal to 256"):
        cli_args("--block-size", str(block_size))
    assert ServeArgs(block_size=32).engine_config("m").block_size == 32


def test_the_engines_fields_keep_the_engines_defaults_and_bounds():
    for name in ("block_size", "max_num_seqs", "gpu_memory_utilization", "swap_space", "tensor_parallel_size"):
        ours, engines = ServeArgs.model_fields[name], EngineConfig.model_fields[name]
        assert (ours.default, ours.metadata) == (engines.default, engines.metadata), name
        assert ours.description, name


def test_each_replica_asks_for_one_strict_pack_bundle_per_tp_rank():
    args = ServeArgs(tensor_parallel_size=2, cpus_per_rank=0.5, device="cpu")
    assert placement_group_bundles(args) == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert placement_group_bundles(ServeArgs(tensor_parallel_size=4, device="cuda")) == [{"CPU": 1.0, "GPU": 1}] * 4
    options = deployment_options(args)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    # the replica itself lives in bundle 0, its HTTP app on Serve's own event loop
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "runtime_env": {"env_vars": REPLICA_SERVE_ENV}}


def test_what_a_replica_asks_of_a_node_is_one_setting():
    # a custom resource that only the nodes meant for replicas have, as a GPU would be
    args = ServeArgs(tensor_parallel_size=2, cpus_per_rank=0.5, device="cpu", accelerator_resource="accel",
                     accelerator_per_rank=0.5, placement_group_strategy="PACK")
    options = deployment_options(args)
    assert options["placement_group_bundles"] == [{"CPU": 0.5, "accel": 0.5}] * 2
    assert options["placement_group_strategy"] == "PACK"
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "resources": {"accel": 0.5},
                                            "runtime_env": {"env_vars": REPLICA_SERVE_ENV}}
    # the ingress asks for CPUs only: it runs on any node, the head included
    ingress = build_app(args.model_copy(update={"max_replicas": 2}))
    assert set(ingress._bound_deployment.ray_actor_options) == {"num_cpus", "runtime_env"}


def test_max_ongoing_requests_follows_the_engine_batch():
    assert max_ongoing_requests(ServeArgs(max_num_seqs=64)) == 72
    assert max_ongoing_requests(ServeArgs(max_num_seqs=2)) == 4
    assert max_ongoing_requests(ServeArgs(max_ongoing_requests=3)) == 3


def test_autoscaling_config_is_used_unless_replicas_are_fixed():
    scaled = deployment_options(ServeArgs(min_replicas=1, max_replicas=4, target_queue_depth=3))
    config = scaled["autoscaling_config"]
    assert (config["min_replicas"], config["max_replicas"]) == (1, 4)
    assert config["metrics_interval_s"] == METRICS_INTERVAL_S <= 0.5
    assert config["policy"]["policy_kwargs"] == {"target_queue_depth": 3}
    fixed = deployment_options(ServeArgs(num_replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    # nothing to scale between equal bounds (the default, 1 and 1): fixed, with no metrics pushed for a policy
    for low in (1, 3):
        equal = deployment_options(ServeArgs(min_replicas=low, max_replicas=low))
        assert equal["num_replicas"] == low and "autoscaling_config" not in equal


def test_the_request_router_serves_only_where_there_can_be_several_replicas():
    assert "request_router_config" not in deployment_options(ServeArgs())  # one replica: Serve's own, no cost
    assert "request_router_config" not in deployment_options(ServeArgs(num_replicas=2, routing="serve-default"))
    routed = deployment_options(serve_args_from(build_parser().parse_args(
        ["serve", "--max-replicas", "3", "--routing", "load", "--routing-max-imbalance", "2", "--block-size", "32"])))
    config = routed["request_router_config"]
    assert config.request_router_class.endswith("PrefixAwareRouter")
    routing = config.request_router_kwargs["routing"]
    assert (routing["mode"], routing["max_imbalance"], routing["block_size"]) == ("load", 2, 32)
    assert config.request_routing_stats_period_s == ServeArgs().routing_stats_period_s


def test_an_ingress_fronts_the_engine_replicas_wherever_the_request_router_serves():
    for alone in (ServeArgs(), ServeArgs(num_replicas=2, routing="serve-default")):
        deployment = build_app(alone)._bound_deployment
        assert deployment.name == "LLMServer"  # Serve's proxy calls the replicas' own HTTP app: no extra hop
    for routing in ("prefix", "load"):
        ingress = build_app(ServeArgs(max_replicas=3, routing=routing, ingress_replicas=2))._bound_deployment
        engine = ingress.init_args[1]._bound_deployment
        assert (ingress.name, ingress.num_replicas, ingress.ray_actor_options["num_cpus"]) == ("OpenAIIngress", 2, 0.1)
        # Serve's code, router and loop share one thread in the ingress process; the engine replicas route
        # nothing, and run their code on Serve's loop
        assert ingress.ray_actor_options["runtime_env"]["env_vars"]["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
        assert engine.ray_actor_options["runtime_env"]["env_vars"] == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
        assert engine.name == "LLMServer"
        router = engine._deployment_config.request_router_config
        assert router.request_router_kwargs["listener"] == "app.routing.telemetry:TELEMETRY"
        assert router.request_router_kwargs["routing"]["mode"] == routing
        # the ingress holds as many requests as the engine replicas and their routers' queues together
        assert ingress.max_ongoing_requests * 2 >= 3 * (engine.max_ongoing_requests + ServeArgs().max_waiting_requests)


class Ctx:
    def __init__(self, depths, queued=0, total=0, min_replicas=1, max_replicas=4):
        self.aggregated_metrics = {QUEUE_DEPTH_METRIC: dict(enumerate(depths))} if depths is not None else {}
        self.total_queued_requests = queued
        self.total_num_requests = total
        self.capacity_adjusted_min_replicas = min_replicas
        self.capacity_adjusted_max_replicas = max_replicas


@pytest.mark.parametrize(("ctx", "desired"), [
    (Ctx([0.0]), 1),                       # idle: min_replicas
    (Ctx([8.0]), 2),                       # 8 deep at target 4: two replicas
    (Ctx([4.0, 4.0], queued=5), 4),        # router-queued requests count too
    (Ctx([40.0]), 4),                      # capped at max_replicas
    (Ctx([0.0, 0.0], min_replicas=0), 0),  # scale to zero when allowed
    (Ctx(None, total=9), 3),               # before any replica reports: Serve's request count
])
def test_policy_wants_queue_depth_over_target_replicas(ctx, desired):
    replicas, state = QueueDepthPolicy(target_queue_depth=4)(ctx)
    assert replicas == desired
    assert "queue_depth" in state


def test_the_served_token_budget_defaults_to_short_steps_on_cpu(tiny_llama_dir):
    assert ServeArgs(device="cpu").engine_config(str(tiny_llama_dir)).max_num_batched_tokens == 2048
    assert ServeArgs(device="cuda").engine_config(str(tiny_llama_dir)).max_num_batched_tokens == 8192
    explicit = ServeArgs(device="cpu", max_num_batched_tokens=512).engine_config(str(tiny_llama_dir))
    assert explicit.max_num_batched_tokens == 512
    assert cli_args("--max-num-batched-tokens", "4096").max_num_batched_tokens == 4096
    assert cli_args("--stream-interval-ms", "0").stream_interval_ms == 0


def test_sampling_defaults_are_the_models_generation_config_with_the_flags_on_top():
    from app import model_defaults
    from engine.checkpoint.demo import DEMO_GENERATION_CONFIG

    def default_sampling(args: ServeArgs) -> dict[str, float]:
        return model_defaults.default_sampling(args.model, args.generation_config, args.override_generation_config)

    assert cli_args("--override-generation-config", '{"temperature": 0.3, "top_k": 40}').override_generation_config == {
        "temperature": 0.3, "top_k": 40}
    assert default_sampling(cli_args()) == DEMO_GENERATION_CONFIG  # no --model: the demo model's own
    overridden = default_sampling(cli_args("--override-generation-config", '{"temperature": 0.3}'))
    assert overridden == {**DEMO_GENERATION_CONFIG, "temperature": 0.3}  # merged, as vLLM merges
    assert default_sampling(cli_args("--generation-config", "vllm")) == {}  # neutral: temperature 1
    assert default_sampling(cli_args("--model", "/models/x")) == {}  # no generation_config.json there
    with pytest.raises(SystemExit, match="--override-generation-config 'temprature': Input should be 'temperature'"):
        cli_args("--override-generation-config", '{"temprature": 0.3}')


def test_health_check_flags_reach_serve_and_the_default_replaces_a_dead_replica_within_seconds():
    options = deployment_options(cli_args("--health-check-period-s", "0.5", "--health-check-timeout-s", "4"))
    assert (options["health_check_period_s"], options["health_check_timeout_s"]) == (0.5, 4.0)
    # Serve takes a replica out after 3 failed checks in a row: at most ~2 s apart, that is within ~6 s
    assert deployment_options(ServeArgs())["health_check_period_s"] <= 2


def test_every_rayservice_pod_starts_ray_with_the_quiet_control_plane():
    """The RayService's pods carry --control-plane quiet's settings (Ray reads them when its processes start)."""
    from app.control_plane import QUIET_ENV

    assert ServeArgs().control_plane == "quiet"
    manifest = yaml.safe_load((SERVE_YAML.parent / "rayservice.yaml").read_text())
    spec = manifest["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            assert {k: env.get(k) for k in QUIET_ENV} == QUIET_ENV, container["name"]
