"""CKV_SHARD_3: RayService worker groups that request nvidia.com/gpu tolerate the GPU nodes' taint."""

from __future__ import annotations

from typing import Any

from checkov.common.models.enums import CheckCategories, CheckResult
from checkov.terraform.checks.resource.base_resource_check import BaseResourceCheck


def _first(value: Any) -> Any:
    while isinstance(value, list) and len(value) == 1 and isinstance(value[0], (dict, list)):
        value = value[0]
    return value


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        obj = _first(obj)
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return _first(obj)


def _requests_gpu(group: dict) -> bool:
    containers = _get(group, "template", "spec", "containers") or []
    containers = containers if isinstance(containers, list) else [containers]
    for c in containers:
        for section in ("limits", "requests"):
            if _get(c, "resources", section, "nvidia.com/gpu") not in (None, 0, "0"):
                return True
    return False


def _tolerates(group: dict) -> bool:
    tolerations = _get(group, "template", "spec", "tolerations") or []
    tolerations = tolerations if isinstance(tolerations, list) else [tolerations]
    return any(
        isinstance(t, dict) and _get(t, "key") == "nvidia.com/gpu" and _get(t, "effect") in (None, "NoSchedule")
        for t in tolerations
    )


class RayServiceGpuToleration(BaseResourceCheck):
    def __init__(self) -> None:
        super().__init__(
            name="RayService GPU worker groups tolerate nvidia.com/gpu NoSchedule",
            id="CKV_SHARD_3",
            categories=[CheckCategories.KUBERNETES],
            supported_resources=["kubernetes_manifest"],
        )

    def scan_resource_conf(self, conf: dict[str, list[Any]]) -> CheckResult:
        manifest = _first(conf.get("manifest"))
        if _get(manifest, "kind") != "RayService":
            return CheckResult.UNKNOWN
        groups = _get(manifest, "spec", "rayClusterConfig", "workerGroupSpecs") or []
        groups = groups if isinstance(groups, list) else [groups]
        gpu_groups = [g for g in groups if isinstance(_first(g), dict) and _requests_gpu(_first(g))]
        if not gpu_groups:
            return CheckResult.UNKNOWN
        return CheckResult.PASSED if all(_tolerates(_first(g)) for g in gpu_groups) else CheckResult.FAILED


check = RayServiceGpuToleration()
