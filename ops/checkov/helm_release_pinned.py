"""CKV_SHARD_2: every helm_release pins an exact chart version."""

from __future__ import annotations

import re
from typing import Any

from checkov.common.models.enums import CheckCategories, CheckResult
from checkov.terraform.checks.resource.base_resource_check import BaseResourceCheck

EXACT_VERSION = re.compile(r"^\d+\.\d+\.\d+([-+][0-9A-Za-z.-]+)?$")


class HelmReleasePinned(BaseResourceCheck):
    def __init__(self) -> None:
        super().__init__(
            name="helm_release pins an exact chart version",
            id="CKV_SHARD_2",
            categories=[CheckCategories.SUPPLY_CHAIN],
            supported_resources=["helm_release"],
        )

    def scan_resource_conf(self, conf: dict[str, list[Any]]) -> CheckResult:
        version = (conf.get("version") or [None])[0]
        return CheckResult.PASSED if isinstance(version, str) and EXACT_VERSION.match(version) else CheckResult.FAILED


check = HelmReleasePinned()
