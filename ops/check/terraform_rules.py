"""Project rules for ops/terraform: variables, pins, GPU taints, sizes, and what examples pass to modules."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ops.check.findings import Finding, where
from ops.check.hcl import Block, HclReadError, read_tfvars
from ops.check.kuberay import check_rayservice
from ops.check.terraform import (
    MODULE_META_ARGUMENTS,
    UNKNOWN,
    Module,
    Scope,
    body_values,
    evaluate,
    load_module,
    module_scope,
)

GPU_TAINT_KEY = "nvidia.com/gpu"
EKS_NO_SCHEDULE = "NO_SCHEDULE"  # the EKS API's enum; Kubernetes itself spells it NoSchedule
TFVARS_EXAMPLE = "terraform.tfvars.example"
EXACT_VERSION = re.compile(r"^\d+\.\d+\.\d+([-+][0-9A-Za-z.-]+)?$")
# GPUs per instance for the types the modules may pick; a type missing here is reported.
GPUS_PER_INSTANCE = {
    "g5.xlarge": 1, "g5.2xlarge": 1, "g5.4xlarge": 1, "g5.8xlarge": 1, "g5.16xlarge": 1,
    "g5.12xlarge": 4, "g5.24xlarge": 4, "g5.48xlarge": 8,
    "g6.xlarge": 1, "g6.2xlarge": 1, "g6.4xlarge": 1, "g6.8xlarge": 1, "g6.16xlarge": 1,
    "g6.12xlarge": 4, "g6.24xlarge": 4, "g6.48xlarge": 8,
    "g6e.xlarge": 1, "g6e.2xlarge": 1, "g6e.4xlarge": 1, "g6e.8xlarge": 1, "g6e.16xlarge": 1,
    "g6e.12xlarge": 4, "g6e.24xlarge": 4, "g6e.48xlarge": 8,
    "p4d.24xlarge": 8, "p4de.24xlarge": 8, "p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8,
}


def check_variables(module: Module, root: Path) -> list[Finding]:
    """Every `var.x` read is declared, and every declared variable is read."""
    findings = []
    declared = module.variables
    uses = module.variable_uses()
    for name, places in sorted(uses.items()):
        if name not in declared:
            path, line = places[0]
            findings.append(Finding("undeclared-variable", where(path, line, root), f"var.{name} is used but not declared"))
    for name, block in sorted(declared.items()):
        if name not in uses:
            findings.append(Finding("unused-variable", where(block.path, block.line, root), f"variable {name!r} is declared but never used"))
    return findings


def check_pins(module: Module, root: Path) -> list[Finding]:
    """Every helm_release pins an exact chart version; every registry module an exact version."""
    findings = []
    scope = module_scope(module)
    for block in module.of_type("resource", "helm_release"):
        attr = block.body.attributes.get("version")
        value = evaluate(attr.value, scope) if attr else None
        if not (isinstance(value, str) and EXACT_VERSION.match(value)):
            findings.append(Finding("unpinned-helm-release", where(block.path, block.line, root),
                                    f"helm_release {block.labels[1]!r} must pin an exact chart version (version = \"1.2.3\"), got {value!r}"))
    for name, block in module.module_calls().items():
        source = evaluate(block.body.attributes["source"].value, scope) if "source" in block.body.attributes else None
        if isinstance(source, str) and not source.startswith((".", "/")):
            attr = block.body.attributes.get("version")
            value = evaluate(attr.value, scope) if attr else None
            if not (isinstance(value, str) and EXACT_VERSION.match(value)):
                findings.append(Finding("unpinned-module", where(block.path, block.line, root),
                                        f"module {name!r} from {source!r} must pin an exact version, got {value!r}"))
    return findings


def _node_groups(module: Module, scope: Scope) -> list[tuple[str, dict[str, Any], Any]]:
    """(name, evaluated settings, block) for each EKS managed node group of the module."""
    groups = []
    for call in module.module_calls().values():
        attr = call.body.attributes.get("eks_managed_node_groups")
        if attr is None:
            continue
        value = evaluate(attr.value, scope)
        if isinstance(value, dict):
            groups += [(name, g, call) for name, g in value.items() if isinstance(g, dict)]
    for block in module.of_type("resource", "aws_eks_node_group"):
        settings = body_values(block.body, scope)
        for inner in block.body.blocks_of("scaling_config"):
            settings.update(body_values(inner.body, scope))
        settings["taints"] = {str(i): body_values(t.body, scope) for i, t in enumerate(block.body.blocks_of("taint"))}
        groups.append((block.labels[1], settings, block))
    return groups


def _is_gpu_group(settings: dict[str, Any]) -> bool:
    ami = settings.get("ami_type")
    types = settings.get("instance_types")
    if isinstance(ami, str) and ("NVIDIA" in ami or "GPU" in ami):
        return True
    return isinstance(types, list) and any(isinstance(t, str) and t in GPUS_PER_INSTANCE for t in types)


def check_node_groups(module: Module, scope: Scope, root: Path, context: str = "") -> list[Finding]:
    """GPU node groups carry the nvidia.com/gpu NO_SCHEDULE taint; min <= desired <= max."""
    findings = []
    for name, settings, block in _node_groups(module, scope):
        at = where(block.path, block.line, root) + context
        if _is_gpu_group(settings):
            taints = settings.get("taints")
            taints = list(taints.values()) if isinstance(taints, dict) else taints or []
            gpu_taints = [t for t in taints if isinstance(t, dict) and t.get("key") == GPU_TAINT_KEY]
            if not gpu_taints:
                findings.append(Finding("gpu-taint", at, f"GPU node group {name!r} needs taint {GPU_TAINT_KEY} with effect {EKS_NO_SCHEDULE}"))
            for t in gpu_taints:
                if t.get("effect") != EKS_NO_SCHEDULE:
                    findings.append(Finding("gpu-taint", at, f"GPU node group {name!r}: taint effect {t.get('effect')!r} must be {EKS_NO_SCHEDULE} (the EKS enum)"))
        sizes = {k: settings.get(k) for k in ("min_size", "desired_size", "max_size")}
        known = {k: v for k, v in sizes.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "min_size" in known and known["min_size"] < 0:
            findings.append(Finding("min-max", at, f"node group {name!r}: min_size {known['min_size']} < 0"))
        for lo, hi in (("min_size", "max_size"), ("min_size", "desired_size"), ("desired_size", "max_size")):
            if lo in known and hi in known and known[lo] > known[hi]:
                findings.append(Finding("min-max", at, f"node group {name!r}: {lo} {known[lo]} > {hi} {known[hi]}"))
    return findings


def rayservice_manifests(module: Module, scope: Scope) -> list[tuple[Block, dict[str, Any]]]:
    """(block, manifest) for each kubernetes_manifest of kind RayService, rendered in `scope`."""
    manifests = []
    for block in module.of_type("resource", "kubernetes_manifest"):
        attr = block.body.attributes.get("manifest")
        manifest = evaluate(attr.value, scope) if attr else UNKNOWN
        if isinstance(manifest, dict) and manifest.get("kind") == "RayService":
            manifests.append((block, manifest))
    return manifests


def check_rayservices(module: Module, scope: Scope, root: Path, context: str = "") -> list[Finding]:
    """Each kubernetes_manifest of kind RayService, rendered in `scope`, passes the KubeRay rules."""
    findings = []
    for block, manifest in rayservice_manifests(module, scope):
        findings += check_rayservice(manifest, where(block.path, block.line, root) + context)
    return findings


def _call_inputs(call, scope: Scope) -> dict[str, Any]:
    return {name: evaluate(a.value, scope) for name, a in call.body.attributes.items() if name not in MODULE_META_ARGUMENTS}


def example_scope(example: Module) -> Scope:
    """The example's variables as its terraform.tfvars.example sets them, defaults for the rest."""
    variables = example.defaults()
    tfvars_path = example.dir / TFVARS_EXAMPLE
    if tfvars_path.exists():
        variables.update({name: evaluate(attr.value, Scope({}, {})) for name, attr in read_tfvars(tfvars_path).items()})
    return Scope(variables, example.locals)


def local_module_calls(example: Module) -> list[tuple[str, Block, Module]]:
    """(name, call, module) for each call of a module from this repository (a relative source)."""
    calls = []
    for name, call in example.module_calls().items():
        source = call.body.attributes.get("source")
        if source is not None and isinstance(source.value, str) and source.value.startswith("."):
            calls.append((name, call, load_module((example.dir / source.value).resolve())))
    return calls


def example_module_scope(module: Module, call: Block, example_values: Scope) -> Scope:
    """The scope of `module` as the example's `call` sets it up."""
    return module_scope(module, _call_inputs(call, example_values))


def check_example(example: Module, root: Path) -> list[Finding]:
    """An example root module: tfvars and module arguments declared, then every module rule on its values."""
    findings = []
    tfvars_path = example.dir / TFVARS_EXAMPLE
    if not tfvars_path.exists():
        findings.append(Finding("example-tfvars", where(example.dir, None, root), f"missing {TFVARS_EXAMPLE}"))
    else:
        tfvars = read_tfvars(tfvars_path)
        for name, attr in tfvars.items():
            if name not in example.variables:
                findings.append(Finding("undeclared-input", where(tfvars_path, attr.line, root), f"{name!r} is not a variable of {example.dir.name}"))
        for name in sorted(example.required_variables() - set(tfvars)):
            findings.append(Finding("undeclared-input", where(tfvars_path, None, root), f"required variable {name!r} is not set"))
    scope = example_scope(example)
    inputs_by_source: dict[str, dict[str, Any]] = {}
    for name, call, module in local_module_calls(example):
        for arg, attr in call.body.attributes.items():
            if arg not in MODULE_META_ARGUMENTS and arg not in module.variables:
                findings.append(Finding("undeclared-input", where(call.path, attr.line, root), f"module {name!r} has no variable {arg!r}"))
        for missing in sorted(module.required_variables() - set(call.body.attributes)):
            findings.append(Finding("undeclared-input", where(call.path, call.line, root), f"module {name!r}: required variable {missing!r} not set"))
        module_values = example_module_scope(module, call, scope)
        inputs_by_source[module.dir.name] = module_values.variables
        context = f" (as {example.dir.name}/module.{name})"
        findings += check_node_groups(module, module_values, root, context)
        findings += check_rayservices(module, module_values, root, context)
    findings += check_capacity(inputs_by_source, where(example.dir / "main.tf", None, root))
    return findings


def check_default_capacity(terraform_root: Path, root: Path) -> list[Finding]:
    """The two modules with their defaults: gpu-cluster's GPU nodes at max size hold shardserve's max_replicas."""
    dirs = {name: terraform_root / "modules" / name for name in ("gpu-cluster", "shardserve")}
    if not all(d.is_dir() for d in dirs.values()):
        return []
    try:
        inputs = {name: module_scope(load_module(d)).variables for name, d in dirs.items()}
    except HclReadError:
        return []  # check_terraform reports the file it could not read
    return check_capacity(inputs, where(dirs["shardserve"] / "variables.tf", None, root) + " (defaults)")


def check_capacity(inputs: dict[str, dict[str, Any]], at: str) -> list[Finding]:
    """The GPU node group at max size holds max_replicas replicas of tensor_parallel_size GPUs.

    `inputs` holds the variables of the gpu-cluster and shardserve modules, by directory name.
    """
    cluster, serve = inputs.get("gpu-cluster"), inputs.get("shardserve")
    if cluster is None or serve is None:
        return []
    tp, serve_tp = cluster.get("tensor_parallel_size"), serve.get("tensor_parallel_size")
    if tp != serve_tp:
        return [Finding("capacity", at, f"gpu-cluster tensor_parallel_size {tp} != shardserve tensor_parallel_size {serve_tp}")]
    types = cluster.get("gpu_instance_types")
    instance = types.get(str(tp)) if isinstance(types, dict) and isinstance(tp, int) else None
    if instance not in GPUS_PER_INSTANCE:
        return [Finding("capacity", at, f"no known GPU count for instance type {instance!r} (TP={tp}); add it to GPUS_PER_INSTANCE")]
    gpus = GPUS_PER_INSTANCE[instance]
    if gpus < tp:
        return [Finding("capacity", at, f"{instance} has {gpus} GPUs, fewer than tensor_parallel_size {tp}")]
    nodes, replicas = cluster.get("gpu_node_max_size"), serve.get("max_replicas")
    if isinstance(nodes, int) and isinstance(replicas, int) and nodes * (gpus // tp) < replicas:
        return [Finding("capacity", at, f"max_replicas {replicas} x TP {tp} needs more than gpu_node_max_size {nodes} x {gpus} GPUs ({instance})")]
    return []
