#!/usr/bin/env bash
# lint-ops: offline validation of ops/terraform, configs/*.yaml and the Dockerfile.
#   ops/lint-ops.sh [ROOT]   (ROOT: a tree with ops/terraform, configs/, Dockerfile; default: this repo)
# 1. HCL syntax of every .tf / .tfvars.example file, by Terraform's own parser (@cdktf/hcl2json)
# 2. project rules in Python (python -m ops.check): variables, pins, taints/tolerations, sizes,
#    example inputs, serve configs parsed by app.config.ServeArgs
# 3. checkov with the custom GPU policies in ops/checkov: any finding not skipped with a reason fails,
#    and so does any file checkov could not parse
# The tools live in .venv-ops (git-ignored), created on first use from PyPI and npm.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET="$(cd "${1:-$REPO}" && pwd)"
OPS_VENV="${OPS_VENV:-$REPO/.venv-ops}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
CHECKOV_VERSION=3.3.30
HCL2JSON_VERSION=0.21.0
failed=()

ensure_ops_env() {
  local marker="$OPS_VENV/.ready-checkov-$CHECKOV_VERSION-hcl2json-$HCL2JSON_VERSION"
  [[ -f "$marker" ]] && return 0
  echo "lint-ops: creating $OPS_VENV (checkov $CHECKOV_VERSION, @cdktf/hcl2json $HCL2JSON_VERSION)"
  local started=$SECONDS
  "${OPS_PYTHON:-python3}" -m venv "$OPS_VENV" &&
    "$OPS_VENV/bin/pip" install --disable-pip-version-check -q "checkov==$CHECKOV_VERSION" >"$OPS_VENV/install.log" 2>&1 &&
    npm install --no-audit --no-fund --silent --prefix "$OPS_VENV/node" "@cdktf/hcl2json@$HCL2JSON_VERSION" >>"$OPS_VENV/install.log" 2>&1 ||
    { grep -v "is ignored" "$OPS_VENV/install.log" | tail -20; echo "lint-ops: installing the tools failed"; return 1; }
  touch "$marker"
  echo "lint-ops: tools installed in $((SECONDS - started)) s"
}

step() {  # step NAME COMMAND...: run, record a failure, keep going
  local name="$1" started=$SECONDS
  shift
  echo "== $name"
  if "$@"; then echo "-- $name: ok ($((SECONDS - started)) s)"; else failed+=("$name"); echo "-- $name: FAILED"; fi
}

hcl_syntax() {
  local files
  mapfile -t files < <(find "$TARGET/ops/terraform" -path '*/.terraform' -prune -o \( -name '*.tf' -o -name '*.tfvars' -o -name '*.tfvars.example' \) -type f -print | sort)
  [[ ${#files[@]} -gt 0 ]] || { echo "no .tf files under $TARGET/ops/terraform"; return 1; }
  NODE_PATH="$OPS_VENV/node/node_modules" node "$REPO/ops/hcl-syntax.cjs" "${files[@]}"
}

project_rules() {
  (cd "$REPO" && "$PYTHON" -m ops.check "$TARGET")
}

checkov_scan() {
  local out rc=0
  out="$(mktemp -d)"
  local common=(--skip-download --external-checks-dir "$REPO/ops/checkov" --output json --soft-fail --quiet)
  # Two scans side by side (checkov reads files given with -f only when no -d is given).
  "$OPS_VENV/bin/checkov" -d "$TARGET/ops/terraform" --framework terraform "${common[@]}" >"$out/terraform.json" 2>"$out/terraform.err" &
  local terraform_pid=$!
  "$OPS_VENV/bin/checkov" -f "$TARGET/Dockerfile" --framework dockerfile "${common[@]}" >"$out/dockerfile.json" 2>"$out/dockerfile.err" || rc=1
  wait "$terraform_pid" || rc=1
  if [[ $rc -ne 0 ]]; then tail -20 "$out"/*.err; rm -rf "$out"; return 1; fi
  (cd "$REPO" && "$PYTHON" -m ops.check.checkov_report "$out/terraform.json" terraform &&
    "$PYTHON" -m ops.check.checkov_report "$out/dockerfile.json" dockerfile) || rc=1
  rm -rf "$out"
  return $rc
}

started=$SECONDS
mkdir -p "$OPS_VENV"
exec 9>"$OPS_VENV/.lock" && flock 9  # one installer at a time
ensure_ops_env || exit 1
step "hcl syntax" hcl_syntax
step "project rules" project_rules
step "checkov" checkov_scan
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "lint-ops: FAILED: ${failed[*]} ($((SECONDS - started)) s)"
  exit 1
fi
echo "lint-ops: all checks passed ($((SECONDS - started)) s)"
