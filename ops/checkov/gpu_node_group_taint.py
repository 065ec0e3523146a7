"""CKV_SHARD_1: EKS managed GPU node groups carry the nvidia.com/gpu taint with the EKS enum NO_SCHEDULE."""

from __future__ import annotations

from typing import Any

from checkov.common.models.enums import CheckCategories, CheckResult
from checkov.terraform.checks.module.base_module_check import BaseModuleCheck


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _is_gpu_group(group: dict) -> bool:
    ami = str(_first(group.get("ami_type", "")))
    return "NVIDIA" in ami or "GPU" in ami


class GpuNodeGroupTaint(BaseModuleCheck):
    def __init__(self) -> None:
        super().__init__(
            name="GPU node groups are tainted nvidia.com/gpu with effect NO_SCHEDULE",
            id="CKV_SHARD_1",
            categories=[CheckCategories.KUBERNETES],
        )

    def scan_module_conf(self, conf: dict[str, list[Any]]) -> CheckResult:
        groups = _first(conf.get("eks_managed_node_groups"))
        if not isinstance(groups, dict):
            return CheckResult.UNKNOWN
        gpu_groups = [g for g in groups.values() if isinstance(g, dict) and _is_gpu_group(g)]
        if not gpu_groups:
            return CheckResult.UNKNOWN
        for group in gpu_groups:
            taints = _first(group.get("taints")) or {}
            taints = taints.values() if isinstance(taints, dict) else taints
            if not any(
                isinstance(t, dict) and _first(t.get("key")) == "nvidia.com/gpu" and _first(t.get("effect")) == "NO_SCHEDULE"
                for t in taints
            ):
                return CheckResult.FAILED
        return CheckResult.PASSED


check = GpuNodeGroupTaint()
