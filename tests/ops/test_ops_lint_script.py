"""ops/lint-ops.sh end to end: passes on the repository, fails on an HCL syntax error and a checkov finding.

These use the real tools in .venv-ops (the script creates it on first use: ~2 minutes), so they
are few; the project rules have their own fast tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ops" / "lint-ops.sh"


def lint(root) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(root)], capture_output=True, text=True, timeout=900)


def test_lint_ops_passes_on_the_repository():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lint-ops: all checks passed" in result.stdout


def test_hcl_syntax_error_fails_the_syntax_step_and_checkov_reports_the_file_unparsed(ops_tree):
    ops_tree.edit("ops/terraform/modules/shardserve/variables.tf", "(ServeArgs.dtype).\"", "(ServeArgs.dtype).")
    result = lint(ops_tree.root)
    assert result.returncode == 1
    assert "-- hcl syntax: FAILED" in result.stdout
    assert "shardserve/variables.tf" in result.stdout and "Invalid multi-line string" in result.stdout
    assert "checkov could not parse" in result.stdout


def test_checkov_findings_fail_each_custom_gpu_policy_and_an_unaccepted_builtin_check(ops_tree):
    # One copy, four planted findings (one lint run): the three custom policies in ops/checkov
    # and a built-in check whose inline skip (the accepted reason) is removed.
    ops_tree.edit("ops/terraform/modules/gpu-cluster/main.tf", 'key    = "nvidia.com/gpu"', 'key    = "dedicated"')
    ops_tree.edit("ops/terraform/modules/gpu-cluster/addons.tf", '  version          = "1.4.2"\n', "")
    ops_tree.edit("ops/terraform/modules/shardserve/main.tf",
                  '{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },', "")
    ops_tree.edit("ops/terraform/modules/gpu-cluster/main.tf", "  #checkov:skip=CKV_AWS_394:", "  # was a skip:")
    result = lint(ops_tree.root)
    assert result.returncode == 1
    assert "-- hcl syntax: ok" in result.stdout
    assert "-- checkov: FAILED" in result.stdout
    for check_id in ("CKV_SHARD_1", "CKV_SHARD_2", "CKV_SHARD_3", "CKV_AWS_394"):
        assert check_id in result.stdout, check_id
