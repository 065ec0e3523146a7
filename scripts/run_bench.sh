#!/usr/bin/env bash
# The serving half of `make bench`: shardserve serve on the bench model, loaded by `shardserve bench` at
# concurrency 1, 10, 50 (512 prompt / 128 output tokens); writes docs/bench_serving.{csv,png} and the
# "Serving benchmark" section of docs/BENCHMARKS.md. Extra arguments go to scripts/bench_serve.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
PY="${VENV:-.venv}/bin/python"
[ -x "$PY" ] || PY=python3
exec "$PY" -m scripts.bench_serve "$@"
