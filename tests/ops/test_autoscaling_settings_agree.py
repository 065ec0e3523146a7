"""The autoscaling settings configs/ and ops/terraform ship agree (`python -m ops.check`, rule autoscaling-drift).

tests/app/test_serve_scaling.py keeps shorter values than any shipped config (delays 0.5 s / 2 s, target 2 at
max_num_seqs 2): the local defaults (2 s / 10 s) would add about 10 s to each of its runs and the cluster's
(30 s / 600 s) ten minutes, and what it checks (up under load, back down when idle) does not depend on the length.
"""

from __future__ import annotations

from pathlib import Path

from ops.check.__main__ import main
from ops.check.autoscaling import RULE, SERVE_ARGS_DEFAULTS, cluster_settings, local_settings
from ops.check.project import check_project

REPO = Path(__file__).resolve().parents[2]
MODULE_VARIABLES = "ops/terraform/modules/shardserve/variables.tf"
RAYSERVICE_YAML = "configs/rayservice.yaml"
SERVE_YAML = "configs/serve.yaml"
MODULE_DEFAULTS = "ops/terraform/modules/shardserve/main.tf"


def drift(tree) -> list:
    """The findings, which must all be autoscaling-drift ones."""
    findings = check_project(tree.root)
    assert findings, "the planted drift was not reported"
    assert {f.rule for f in findings} == {RULE}, [str(f) for f in findings]
    return findings


def test_every_shipped_config_is_read():
    local = [s.where for s in local_settings(REPO)]
    cluster = [s.where for s in cluster_settings(REPO)]
    assert local == [SERVE_ARGS_DEFAULTS, SERVE_YAML]
    assert len(cluster) == 4, cluster
    assert cluster[0].startswith(MODULE_DEFAULTS) and cluster[0].endswith("(defaults)")
    assert any("aws-tp2/module.shardserve" in w for w in cluster) and any("aws-tp4/module.shardserve" in w for w in cluster)
    assert cluster[-1] == RAYSERVICE_YAML


def test_the_cluster_configs_ship_one_set_of_delays_and_a_longer_one_than_the_local_defaults():
    local, cluster = local_settings(REPO), cluster_settings(REPO)
    assert len({(s.upscale_delay_s, s.downscale_delay_s, s.idle_timeout_s, s.min_replicas) for s in cluster}) == 1
    assert cluster[0].upscale_delay_s >= local[0].upscale_delay_s
    assert cluster[0].downscale_delay_s >= local[0].downscale_delay_s


def test_rayservice_downscale_delay_apart_from_terraform_is_reported_naming_both_files(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "          downscale_delay_s: 600\n", "          downscale_delay_s: 60\n")
    [finding] = drift(ops_tree)
    assert finding.where == RAYSERVICE_YAML
    assert "downscale_delay_s 60 differs from 600" in finding.message
    assert MODULE_DEFAULTS in finding.message


def test_terraform_default_upscale_delay_apart_from_the_rayservice_is_reported(ops_tree):
    ops_tree.edit(MODULE_VARIABLES, "  default     = 30\n", "  default     = 45\n")
    # the examples inherit the module's default, so only the plain manifest is left apart
    [finding] = drift(ops_tree)
    assert finding.where == RAYSERVICE_YAML
    assert "upscale_delay_s 30 differs from 45" in finding.message and MODULE_DEFAULTS in finding.message


def test_example_queue_target_apart_from_the_others_as_a_share_of_the_batch_is_reported(ops_tree):
    ops_tree.edit("ops/terraform/examples/aws-tp2/terraform.tfvars.example", "target_queue_depth = 32",
                  "target_queue_depth = 16")
    [finding] = drift(ops_tree)
    assert "aws-tp2/module.shardserve" in finding.where
    assert "target_queue_depth / max_num_seqs 16/64 differs from 32/64" in finding.message


def test_example_scaling_target_and_batch_together_is_not_drift(ops_tree):
    tfvars = "ops/terraform/examples/aws-tp4/terraform.tfvars.example"
    ops_tree.edit(tfvars, "max_num_seqs       = 64", "max_num_seqs       = 128")
    ops_tree.edit(tfvars, "target_queue_depth = 32", "target_queue_depth = 64")
    assert check_project(ops_tree.root) == []
    assert [s.max_num_seqs for s in cluster_settings(ops_tree.root) if "aws-tp4" in s.where] == [128]


def test_ray_autoscaler_idle_timeout_apart_from_terraform_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "idleTimeoutSeconds: 300", "idleTimeoutSeconds: 60")
    [finding] = drift(ops_tree)
    assert finding.where == RAYSERVICE_YAML and "idleTimeoutSeconds" in finding.message


def test_serve_yaml_apart_from_the_cli_defaults_is_reported(ops_tree):
    ops_tree.edit(SERVE_YAML, "      upscale_delay_s: 2.0\n", "      upscale_delay_s: 3.0\n")
    [finding] = drift(ops_tree)
    assert finding.where == SERVE_YAML
    assert "upscale_delay_s 3 differs from" in finding.message and "app/config.py" in finding.message


def test_upscale_slower_than_downscale_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "upscale_delay_s: 30", "upscale_delay_s: 900")
    ops_tree.edit(MODULE_VARIABLES, "  default     = 30\n", "  default     = 900\n")
    findings = drift(ops_tree)
    assert len(findings) == 4, [str(f) for f in findings]  # the module, two examples, the manifest
    assert all("upscale_delay_s 900 > downscale_delay_s 600" in f.message for f in findings)


def test_cluster_delay_shorter_than_the_local_default_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "          upscale_delay_s: 30\n", "          upscale_delay_s: 1\n")
    findings = drift(ops_tree)
    messages = [f.message for f in findings]
    assert {f.where for f in findings} == {RAYSERVICE_YAML}
    assert any("upscale_delay_s 1 is shorter than" in m for m in messages), messages
    assert any("upscale_delay_s 1 differs from 30" in m for m in messages), messages


def test_terraform_default_max_replicas_beyond_the_default_fleet_is_reported(ops_tree):
    ops_tree.edit(MODULE_VARIABLES, "  default     = 2\n", "  default     = 3\n")
    [finding] = check_project(ops_tree.root)
    assert finding.rule == "capacity" and finding.where == f"{MODULE_VARIABLES} (defaults)"
    assert "max_replicas 3" in finding.message


def test_the_ops_lint_command_fails_on_drift_naming_the_setting_and_files(ops_tree, capsys):
    ops_tree.edit(RAYSERVICE_YAML, "          downscale_delay_s: 600\n", "          downscale_delay_s: 60\n")
    assert main([str(ops_tree.root)]) == 1
    out = capsys.readouterr().out
    assert f"{RAYSERVICE_YAML}: [{RULE}] downscale_delay_s 60" in out and MODULE_DEFAULTS in out
    assert "1 finding(s)" in out


def test_worker_group_max_pods_apart_from_max_replicas_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "maxReplicas: 4 # = max_replicas", "maxReplicas: 3 # = max_replicas")
    [finding] = check_project(ops_tree.root)
    assert finding.rule == "replica-bounds" and finding.where == RAYSERVICE_YAML
    assert "maxReplicas 3 != max_replicas 4" in finding.message


def test_worker_group_starting_outside_its_min_and_max_is_reported(ops_tree):
    ops_tree.edit(RAYSERVICE_YAML, "        replicas: 1\n", "        replicas: 5\n")
    [finding] = check_project(ops_tree.root)
    assert finding.rule == "min-max" and "replicas 5 is outside minReplicas 1 .. maxReplicas 4" in finding.message
