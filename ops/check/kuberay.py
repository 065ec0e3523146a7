"""Checks of Ray Serve configs and KubeRay RayService manifests against the app's own settings model.

The same rules read configs/serve.yaml, configs/rayservice.yaml and the RayService the
shardserve Terraform module renders, so the three cannot drift apart.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import ValidationError

from app.config import ServeArgs
from ops.check.findings import Finding
from ops.check.terraform import UNKNOWN, contains_unknown

GPU_RESOURCE = "nvidia.com/gpu"
SERVE_IMPORT_PATH = "app.deployment:build_app"
SERVE_PORT = 8000
# GPU workers are scraped on Ray's metrics export port: with several replicas the ingress answers :8000
METRICS_EXPORT_PORT = "8080"
PROMETHEUS_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": METRICS_EXPORT_PORT,
                          "prometheus.io/path": "/metrics"}


def _errors(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors())


def check_serve_config(config: Any, where: str) -> tuple[list[Finding], list[ServeArgs]]:
    """A Ray Serve config (the `serve run` file or a RayService's serveConfigV2): Ray's schema, then ServeArgs."""
    from ray.serve.schema import ServeDeploySchema  # imported here: ray takes a second to import

    findings: list[Finding] = []
    if not isinstance(config, dict) or not isinstance(config.get("applications"), list) or not config["applications"]:
        return [Finding("serve-config", where, "a Serve config needs a non-empty `applications` list")], []
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        findings.append(Finding("serve-schema", where, f"Ray Serve rejects the config: {_errors(e)}"))
    parsed = []
    for i, app in enumerate(config["applications"]):
        name = app.get("name", i) if isinstance(app, dict) else i
        if not isinstance(app, dict):
            findings.append(Finding("serve-config", where, f"application {i} is not a mapping"))
            continue
        if app.get("import_path") != SERVE_IMPORT_PATH:
            findings.append(
                Finding("serve-import-path", where, f"application {name!r}: import_path must be {SERVE_IMPORT_PATH!r}, not {app.get('import_path')!r}")
            )
        try:
            args = ServeArgs.model_validate(app.get("args") or {})
        except ValidationError as e:
            findings.append(Finding("serve-args", where, f"application {name!r}: ServeArgs rejects args: {_errors(e)}"))
            continue
        parsed.append(args)
        endpoint = args.otlp_traces_endpoint
        if endpoint not in (None, "console") and urlsplit(endpoint).scheme not in ("http", "https", "grpc"):
            findings.append(Finding("serve-args", where, f"application {name!r}: otlp_traces_endpoint {endpoint!r} must be "
                                    "http(s)://host:4318/v1/traces, grpc://host:4317 or console (app/observability/tracing.py)"))
    return findings, parsed


def _gpus(container: dict) -> int:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(GPU_RESOURCE)
        if value is not None and value is not UNKNOWN:
            return int(value)
    return 0


def _cpu_cores(quantity: Any) -> float | None:
    """Kubernetes CPU quantity ("3", "500m", 2) in cores; None when it is not a plain quantity."""
    text = str(quantity)
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None


def _tolerates_gpu_taint(tolerations: Any) -> tuple[bool, str]:
    """Whether the tolerations let a pod onto nodes tainted nvidia.com/gpu=true:NoSchedule."""
    if tolerations is UNKNOWN or contains_unknown(tolerations):
        return False, "tolerations cannot be read statically; write them as literals"
    for t in tolerations or []:
        if t.get("key") != GPU_RESOURCE:
            continue
        if t.get("effect") not in (None, "NoSchedule"):
            return False, f"toleration effect {t.get('effect')!r} does not match; Kubernetes spells it NoSchedule"
        if t.get("operator", "Equal") == "Exists" or t.get("value") == "true":
            return True, ""
        return False, "toleration must use operator Exists or value \"true\""
    return False, f"no toleration for the {GPU_RESOURCE} NoSchedule taint of the GPU nodes"


def _check_gpu_worker(group: dict, args: ServeArgs | None, where: str) -> list[Finding]:
    findings = []
    name = group.get("groupName", "?")
    pod = (group.get("template") or {}).get("spec") or {}
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    gpus = max((_gpus(c) for c in containers), default=0)
    ok, why = _tolerates_gpu_taint(pod.get("tolerations"))
    if not ok:
        findings.append(Finding("gpu-toleration", where, f"worker group {name!r} requests {GPU_RESOURCE}: {why}"))
    lo, hi = group.get("minReplicas"), group.get("maxReplicas")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        findings.append(Finding("min-max", where, f"worker group {name!r}: minReplicas {lo} > maxReplicas {hi}"))
    start = group.get("replicas")
    if all(isinstance(n, int) for n in (lo, start, hi)) and not lo <= start <= hi:
        findings.append(Finding("min-max", where, f"worker group {name!r}: replicas {start} is outside "
                                f"minReplicas {lo} .. maxReplicas {hi}"))
    if args is not None:
        if args.accelerator_resource != "GPU":
            findings.append(Finding("accelerator-resource", where, f"worker group {name!r} offers {GPU_RESOURCE} but the replicas ask for accelerator_resource {args.accelerator_resource!r}: set it to GPU, so that a replica places only on a GPU worker and its ranks get their GPUs"))
        elif gpus != args.tensor_parallel_size * args.accelerator_per_rank:
            findings.append(Finding("gpus-per-replica", where, f"worker group {name!r} requests {gpus} GPUs per pod but tensor_parallel_size is {args.tensor_parallel_size} (x accelerator_per_rank {args.accelerator_per_rank:g}): one pod hosts one replica"))
        cpus = [_cpu_cores(((c.get("resources") or {}).get("limits") or {}).get("cpu")) for c in containers]
        needed = args.tensor_parallel_size * args.cpus_per_rank
        if any(cpu is not None and cpu < needed for cpu in cpus):
            findings.append(Finding("cpus-per-replica", where, f"worker group {name!r}: pods have fewer CPUs than the replica's placement group needs (tensor_parallel_size x cpus_per_rank = {needed:g})"))
        if lo is not UNKNOWN and lo != args.min_replicas:
            findings.append(Finding("replica-bounds", where, f"worker group {name!r}: minReplicas {lo} != min_replicas {args.min_replicas}"))
        if hi is not UNKNOWN and hi != args.max_replicas:
            findings.append(Finding("replica-bounds", where, f"worker group {name!r}: maxReplicas {hi} != max_replicas {args.max_replicas}"))
    annotations = ((group.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    if not contains_unknown(annotations) and any(annotations.get(k) != v for k, v in PROMETHEUS_ANNOTATIONS.items()):
        findings.append(Finding("prometheus-annotations", where, f"worker group {name!r} pods need annotations {PROMETHEUS_ANNOTATIONS}"))
    export_port = (group.get("rayStartParams") or {}).get("metrics-export-port")
    if not contains_unknown(export_port) and str(export_port) != METRICS_EXPORT_PORT:
        findings.append(Finding("metrics-export-port", where, f"worker group {name!r}: rayStartParams needs metrics-export-port \"{METRICS_EXPORT_PORT}\" (the port its pods are scraped on)"))
    probes = [c.get("readinessProbe") for c in containers]
    if not any(isinstance(p, dict) and (p.get("httpGet") or {}).get("path") == "/health" for p in probes):
        findings.append(Finding("readiness-probe", where, f"worker group {name!r}: readinessProbe must GET /health on port {SERVE_PORT}"))
    return findings


def check_rayservice(manifest: Any, where: str) -> list[Finding]:
    """A RayService: serve config, autoscaling, GPU workers' toleration and sizes, port 8000 on the head."""
    if not isinstance(manifest, dict) or manifest.get("kind") != "RayService":
        return [Finding("rayservice", where, "expected a manifest of kind RayService")]
    spec = manifest.get("spec") or {}
    findings: list[Finding] = []
    raw_config = spec.get("serveConfigV2")
    args = None
    if not isinstance(raw_config, str):
        findings.append(Finding("serve-config", where, "spec.serveConfigV2 must be a YAML string the checker can read"))
    else:
        serve_config = yaml.safe_load(raw_config)
        serve_findings, parsed = check_serve_config(serve_config, where + " (serveConfigV2)")
        findings += serve_findings
        host = ((serve_config or {}).get("http_options") or {}).get("host")
        if host != "0.0.0.0":
            findings.append(Finding("serve-http-host", where, f"serveConfigV2 http_options.host is {host!r}; in a pod the proxy must listen on 0.0.0.0"))
        args = parsed[0] if len(parsed) == 1 else None
    cluster = spec.get("rayClusterConfig") or {}
    if cluster.get("enableInTreeAutoscaling") is not True:
        findings.append(Finding("ray-autoscaler", where, "rayClusterConfig.enableInTreeAutoscaling must be true"))
    head = ((cluster.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
    head_ports = [p.get("containerPort") for c in head.get("containers") or [] for p in c.get("ports") or []]
    if SERVE_PORT not in head_ports:
        findings.append(Finding("head-serve-port", where, f"the head container must expose port {SERVE_PORT}"))
    gpu_groups = [
        g for g in cluster.get("workerGroupSpecs") or []
        if any(_gpus(c) for c in (((g.get("template") or {}).get("spec") or {}).get("containers") or []))
    ]
    if not gpu_groups:
        findings.append(Finding("gpu-workers", where, f"no worker group requests {GPU_RESOURCE}"))
    for group in gpu_groups:
        findings += _check_gpu_worker(group, args, where)
    return findings
