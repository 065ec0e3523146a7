"""The autoscaling settings every shipped config holds, read from each, and the rules that tie them together.

Two profiles ship. The local one is ServeArgs' defaults (app/config.py), which configs/serve.yaml repeats.
The cluster one is the shardserve Terraform module's defaults, what each example under
ops/terraform/examples renders, and configs/rayservice.yaml (for clusters not built with Terraform).
Within the cluster profile the delays, min_replicas, the Ray autoscaler's idle timeout and the queue
target as a share of the batch (target_queue_depth / max_num_seqs) are one value everywhere.
max_replicas may differ: each cluster config sizes it to its fleet (the capacity rule) and its worker group
follows it (the replica-bounds rule in kuberay.py). Between the profiles the cluster's delays are the
longer: a cluster replica takes minutes to bring back (node boot, model copy, weight load), a local one
seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from app.config import ServeArgs
from ops.check.findings import Finding, where
from ops.check.hcl import HclReadError
from ops.check.terraform import load_module, module_dirs, module_scope
from ops.check.terraform_rules import (
    example_module_scope,
    example_scope,
    local_module_calls,
    rayservice_manifests,
)

RULE = "autoscaling-drift"
SERVE_ARGS_DEFAULTS = "app/config.py (ServeArgs defaults)"
SERVE_FIELDS = ("min_replicas", "max_replicas", "target_queue_depth", "upscale_delay_s", "downscale_delay_s")


@dataclass(frozen=True)
class AutoscalingSettings:
    """What one shipped config sets for autoscaling; `where` names it as a finding would."""

    where: str
    min_replicas: int
    max_replicas: int
    target_queue_depth: float
    upscale_delay_s: float
    downscale_delay_s: float
    max_num_seqs: int
    idle_timeout_s: Any = None  # the Ray autoscaler's idleTimeoutSeconds; None outside a RayService

    @classmethod
    def of(cls, where: str, args: ServeArgs, idle_timeout_s: Any = None) -> AutoscalingSettings:
        return cls(where, *(getattr(args, name) for name in SERVE_FIELDS), args.max_num_seqs, idle_timeout_s)

    @property
    def target_share_of_batch(self) -> float:
        return self.target_queue_depth / self.max_num_seqs


def _serve_args(serve_config: Any) -> ServeArgs | None:
    """The one application's ServeArgs; None where other rules report why there is none."""
    apps = serve_config.get("applications") if isinstance(serve_config, dict) else None
    if not isinstance(apps, list) or len(apps) != 1 or not isinstance(apps[0], dict):
        return None
    try:
        return ServeArgs.model_validate(apps[0].get("args") or {})
    except ValidationError:
        return None


def _from_rayservice(at: str, manifest: dict[str, Any]) -> AutoscalingSettings | None:
    spec = manifest.get("spec") or {}
    raw = spec.get("serveConfigV2")
    args = _serve_args(yaml.safe_load(raw)) if isinstance(raw, str) else None
    if args is None:
        return None
    options = (spec.get("rayClusterConfig") or {}).get("autoscalerOptions") or {}
    return AutoscalingSettings.of(at, args, options.get("idleTimeoutSeconds"))


def _yaml_documents(path: Path) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError:
        return []  # check_config_file reports it


def local_settings(root: Path) -> list[AutoscalingSettings]:
    """ServeArgs' defaults first, then each Serve config under configs/ (configs/serve.yaml)."""
    sources = [AutoscalingSettings.of(SERVE_ARGS_DEFAULTS, ServeArgs())]
    for path in sorted((root / "configs").glob("*.yaml")):
        for doc in _yaml_documents(path):
            if isinstance(doc, dict) and "applications" in doc and (args := _serve_args(doc)) is not None:
                sources.append(AutoscalingSettings.of(where(path, None, root), args))
    return sources


def cluster_settings(root: Path) -> list[AutoscalingSettings]:
    """The shardserve module's defaults first (the reference), then each example's rendering, then the
    RayService manifests under configs/."""
    terraform_root = root / "ops" / "terraform"
    defaults, examples = [], []
    for directory in module_dirs(terraform_root):
        try:
            module = load_module(directory)
            if "examples" in directory.relative_to(terraform_root).parts:
                values = example_scope(module)
                for name, call, called in local_module_calls(module):
                    context = f" (as {module.dir.name}/module.{name})"
                    for block, manifest in rayservice_manifests(called, example_module_scope(called, call, values)):
                        examples.append(_from_rayservice(where(block.path, block.line, root) + context, manifest))
            else:
                for block, manifest in rayservice_manifests(module, module_scope(module)):
                    defaults.append(_from_rayservice(where(block.path, block.line, root) + " (defaults)", manifest))
        except HclReadError:
            continue  # check_terraform reports it
    manifests = []
    for path in sorted((root / "configs").glob("*.yaml")):
        for doc in _yaml_documents(path):
            if isinstance(doc, dict) and doc.get("kind") == "RayService":
                manifests.append(_from_rayservice(where(path, None, root), doc))
    return [s for s in defaults + examples + manifests if s is not None]


# Settings every cluster config ships with one value, each with why. The queue target is compared as a share of
# the batch, so a config with a bigger max_num_seqs scales its target with it.
CLUSTER_SHARED = {
    "upscale_delay_s": ("upscale_delay_s", "one fleet, one reaction time to load"),
    "downscale_delay_s": ("downscale_delay_s", "a lull must cost a replica after the same wait everywhere"),
    "min_replicas": ("min_replicas", "the warm replicas kept while scaling up from zero takes minutes"),
    "idle_timeout_s": ("the Ray autoscaler's idleTimeoutSeconds (worker_idle_timeout_s)",
                       "how long an idle worker pod lives before its node can go"),
    "target_share_of_batch": ("target_queue_depth / max_num_seqs", "the queue target is a share of one replica's batch"),
}


def _shown(settings: AutoscalingSettings, name: str) -> str:
    if name == "target_share_of_batch":
        return f"{settings.target_queue_depth:g}/{settings.max_num_seqs}"
    value = getattr(settings, name)
    return f"{value:g}" if isinstance(value, (int, float)) else repr(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


def check_autoscaling(root: Path) -> list[Finding]:
    """The local and cluster profiles each agree within themselves, and relate to each other as the module
    docstring says."""
    findings: list[Finding] = []
    local, cluster = local_settings(root), cluster_settings(root)
    serve_args = local[0]
    # configs/serve.yaml is the CLI's defaults (`shardserve serve` with no flags builds the same app)
    for config in local[1:]:
        for name in SERVE_FIELDS:
            if not _same(getattr(config, name), getattr(serve_args, name)):
                findings.append(Finding(RULE, config.where, f"{name} {_shown(config, name)} differs from "
                                        f"{_shown(serve_args, name)} in {SERVE_ARGS_DEFAULTS}: a Serve config under "
                                        "configs/ holds the CLI's defaults"))
    if cluster:
        reference = cluster[0]
        for config in cluster[1:]:
            for name, (label, why) in CLUSTER_SHARED.items():
                if not _same(getattr(config, name), getattr(reference, name)):
                    findings.append(Finding(RULE, config.where, f"{label} {_shown(config, name)} differs from "
                                            f"{_shown(reference, name)} in {reference.where}: every cluster config "
                                            f"ships one value ({why})"))
    for config in cluster:
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(config, name) < getattr(serve_args, name):
                findings.append(Finding(RULE, config.where, f"{name} {_shown(config, name)} is shorter than "
                                        f"{_shown(serve_args, name)} in {SERVE_ARGS_DEFAULTS}: a cluster replica takes "
                                        "minutes to bring back, a local one seconds, so the cluster waits longer"))
    for config in local + cluster:
        if config.upscale_delay_s > config.downscale_delay_s:
            findings.append(Finding(RULE, config.where, f"upscale_delay_s {_shown(config, 'upscale_delay_s')} > "
                                    f"downscale_delay_s {_shown(config, 'downscale_delay_s')}: a burst must add a "
                                    "replica sooner than a lull removes one"))
        if config.target_queue_depth > config.max_num_seqs:
            findings.append(Finding(RULE, config.where, f"target_queue_depth {_shown(config, 'target_queue_depth')} > "
                                    f"max_num_seqs {config.max_num_seqs}: a replica would queue past its batch "
                                    "before another is asked for"))
    return findings
