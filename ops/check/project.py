"""All offline project checks of ops/terraform and configs/, as one list of findings."""

from __future__ import annotations

from pathlib import Path

import yaml

from app.config import ServeArgs
from ops.check.autoscaling import check_autoscaling
from ops.check.findings import Finding, where
from ops.check.hcl import HclReadError
from ops.check.kuberay import check_rayservice, check_serve_config
from ops.check.terraform import load_module, module_dirs, module_scope
from ops.check.terraform_rules import (
    check_default_capacity,
    check_example,
    check_node_groups,
    check_pins,
    check_rayservices,
    check_variables,
)


def check_terraform(terraform_root: Path, root: Path) -> list[Finding]:
    """Every module directory under `terraform_root`; directories under examples/ also as configured roots."""
    findings: list[Finding] = []
    for directory in module_dirs(terraform_root):
        try:
            module = load_module(directory)
            findings += check_variables(module, root)
            findings += check_pins(module, root)
            if "examples" in directory.relative_to(terraform_root).parts:
                findings += check_example(module, root)
            else:
                defaults = module_scope(module)
                findings += check_node_groups(module, defaults, root, " (defaults)")
                findings += check_rayservices(module, defaults, root, " (defaults)")
        except HclReadError as e:
            findings.append(Finding("hcl-read", where(directory, None, root), str(e)))
    return findings + check_default_capacity(terraform_root, root)


def check_config_file(path: Path, root: Path) -> list[Finding]:
    """A configs/*.yaml file: Serve configs and RayServices by their rules, flat ServeArgs presets by ServeArgs."""
    at = where(path, None, root)
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        return [Finding("yaml", at, f"not valid YAML: {e}")]
    findings: list[Finding] = []
    for doc in documents:
        if isinstance(doc, dict) and "applications" in doc:
            findings += check_serve_config(doc, at)[0]
        elif isinstance(doc, dict) and doc.get("kind") == "RayService":
            findings += check_rayservice(doc, at)
        elif isinstance(doc, dict) and set(doc) & set(ServeArgs.model_fields):
            try:
                ServeArgs.model_validate(doc)
            except ValueError as e:
                findings.append(Finding("serve-args", at, f"ServeArgs rejects this preset: {e}"))
    return findings


def check_project(root: Path) -> list[Finding]:
    """Terraform under ops/terraform and every configs/*.yaml, each by its rules, then their autoscaling together."""
    findings = check_terraform(root / "ops" / "terraform", root)
    for path in sorted((root / "configs").glob("*.yaml")):
        findings += check_config_file(path, root)
    return findings + check_autoscaling(root)
