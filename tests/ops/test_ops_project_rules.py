"""The project rules of `python -m ops.check`: the repository passes, and each planted mistake is caught."""

from __future__ import annotations

from pathlib import Path

from ops.check.project import check_project

REPO = Path(__file__).resolve().parents[2]

SHARDSERVE = "ops/terraform/modules/shardserve/main.tf"
GPU_CLUSTER = "ops/terraform/modules/gpu-cluster/main.tf"
TP2 = "ops/terraform/examples/aws-tp2"
RAYSERVICE_YAML = "configs/rayservice.yaml"


def findings_of(tree):
    return check_project(tree.root)


def only_rule(findings, rule: str, text: str):
    """The findings are all of `rule`, and one of them mentions `text`."""
    assert findings, "the planted mistake was not reported"
    assert {f.rule for f in findings} == {rule}, [str(f) for f in findings]
    assert any(text in f.message for f in findings), [str(f) for f in findings]


def test_repository_terraform_and_configs_pass_every_rule():
    assert [str(f) for f in check_project(REPO)] == []


def test_untouched_copy_passes(ops_tree):
    assert findings_of(ops_tree) == []


def test_variable_used_but_not_declared_is_reported(ops_tree):
    ops_tree.edit(SHARDSERVE, "  serve_config = {", "  typo = var.gpu_count\n\n  serve_config = {")
    only_rule(findings_of(ops_tree), "undeclared-variable", "var.gpu_count")


def test_variable_declared_but_never_used_is_reported(ops_tree):
    path = ops_tree.root / "ops/terraform/modules/gpu-cluster/variables.tf"
    path.write_text(path.read_text() + '\nvariable "orphan" {\n  type    = number\n  default = 1\n}\n')
    only_rule(findings_of(ops_tree), "unused-variable", "orphan")


def test_gpu_node_min_size_above_max_size_is_reported(ops_tree):
    ops_tree.edit(f"{TP2}/terraform.tfvars.example", "gpu_node_min_size = 1", "gpu_node_min_size = 3")
    only_rule(findings_of(ops_tree), "min-max", "min_size 3 > max_size 2")


def test_gpu_node_group_without_the_gpu_taint_is_reported(ops_tree):
    ops_tree.edit(GPU_CLUSTER, 'key    = "nvidia.com/gpu"', 'key    = "dedicated"')
    only_rule(findings_of(ops_tree), "gpu-taint", "needs taint nvidia.com/gpu")


def test_gpu_taint_in_kubernetes_spelling_is_reported_as_the_wrong_eks_enum(ops_tree):
    ops_tree.edit(GPU_CLUSTER, 'effect = "NO_SCHEDULE"', 'effect = "NoSchedule"')
    only_rule(findings_of(ops_tree), "gpu-taint", "must be NO_SCHEDULE")


def test_terraform_rayservice_gpu_workers_without_toleration_are_reported(ops_tree):
    ops_tree.edit(SHARDSERVE, '{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },', "")
    only_rule(findings_of(ops_tree), "gpu-toleration", "no toleration")


def test_plain_rayservice_gpu_workers_without_toleration_are_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "              - key: nvidia.com/gpu\n", "              - key: example.com/other\n")
    only_rule(findings_of(ops_tree), "gpu-toleration", "no toleration")


def test_helm_release_without_a_pinned_version_is_reported(ops_tree):
    ops_tree.edit("ops/terraform/modules/gpu-cluster/addons.tf", '  version          = "1.4.2"\n', "")
    only_rule(findings_of(ops_tree), "unpinned-helm-release", "kuberay_operator")


def test_example_passing_a_variable_the_module_does_not_declare_is_reported(ops_tree):
    ops_tree.edit(f"{TP2}/main.tf", "  gpu_capacity_type    = var.gpu_capacity_type\n",
                  "  gpu_capacity_type    = var.gpu_capacity_type\n  gpu_count            = 4\n")
    only_rule(findings_of(ops_tree), "undeclared-input", "no variable 'gpu_count'")


def test_tfvars_example_setting_an_undeclared_variable_is_reported(ops_tree):
    path = ops_tree.root / TP2 / "terraform.tfvars.example"
    path.write_text(path.read_text() + 'gpu_instance_type = "p5.48xlarge"\n')
    only_rule(findings_of(ops_tree), "undeclared-input", "'gpu_instance_type' is not a variable")


def test_terraform_serve_args_field_that_serveargs_rejects_is_reported(ops_tree):
    ops_tree.edit(SHARDSERVE, '    device                   = "cuda"\n', '    device                   = "cuda"\n    max_num_seq = 8\n')
    only_rule(findings_of(ops_tree), "serve-args", "max_num_seq")


def test_plain_rayservice_serve_args_value_that_serveargs_rejects_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "          gpu_memory_utilization: 0.9", "          gpu_memory_utilization: 1.5")
    only_rule(findings_of(ops_tree), "serve-args", "gpu_memory_utilization")


def test_serve_yaml_with_unknown_field_is_reported(ops_tree):
    (ops_tree.root / "configs/serve.yaml").write_text(
        "applications:\n  - name: shardserve\n    route_prefix: /\n    import_path: app.deployment:build_app\n"
        "    args:\n      tensor_parallel_size: 2\n      max_batch_size: 8\n"
    )
    only_rule(findings_of(ops_tree), "serve-args", "max_batch_size")


def test_worker_gpus_differing_from_tensor_parallel_size_are_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "          tensor_parallel_size: 1", "          tensor_parallel_size: 2")
    only_rule(findings_of(ops_tree), "gpus-per-replica", "tensor_parallel_size is 2")


def test_replicas_asking_for_another_resource_than_the_gpu_workers_offer_are_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "accelerator_resource: GPU ", "accelerator_resource: accel ")
    only_rule(findings_of(ops_tree), "accelerator-resource", "'accel'")


def test_terraform_replicas_asking_for_no_gpu_are_reported(ops_tree):
    ops_tree.edit(SHARDSERVE, 'accelerator_resource     = "GPU"\n', "")
    only_rule(findings_of(ops_tree), "accelerator-resource", "None")


def test_max_replicas_beyond_the_gpu_nodes_capacity_is_reported(ops_tree):
    ops_tree.edit(f"{TP2}/terraform.tfvars.example", "max_replicas       = 4", "max_replicas       = 5")
    only_rule(findings_of(ops_tree), "capacity", "max_replicas 5")


def test_worker_pod_with_fewer_cpus_than_the_placement_group_needs_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, '          downscale_delay_s: 600\n', '          downscale_delay_s: 600\n          cpus_per_rank: 4\n')
    only_rule(findings_of(ops_tree), "cpus-per-replica", "tensor_parallel_size x cpus_per_rank = 4")


def test_otlp_endpoint_without_a_scheme_is_reported(ops_tree):
    ops_tree.edit(f"{TP2}/terraform.tfvars.example",
                  '# otlp_traces_endpoint = "http://otel-collector.observability.svc.cluster.local:4318/v1/traces"',
                  'otlp_traces_endpoint = "otel-collector.observability:4317"')
    only_rule(findings_of(ops_tree), "serve-args", "otlp_traces_endpoint 'otel-collector.observability:4317'")


def test_gpu_workers_scraped_on_a_port_ray_does_not_export_metrics_on_are_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, '          metrics-export-port: "8080"', '          metrics-export-port: "9090"')
    only_rule(findings_of(ops_tree), "metrics-export-port", 'metrics-export-port "8080"')


def test_terraform_gpu_workers_scraped_on_the_serve_port_are_reported(ops_tree):
    ops_tree.edit(SHARDSERVE, '"prometheus.io/port"   = tostring(local.metrics_export_port)', '"prometheus.io/port"   = "8000"')
    only_rule(findings_of(ops_tree), "prometheus-annotations", "8080")
