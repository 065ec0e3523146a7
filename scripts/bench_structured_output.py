"""Structured outputs: xgrammar against llguidance on the same schema, the mask's cost, and the engine's
throughput with every request under a 10-field JSON schema against the same load free (part of `make bench`).

    python -m scripts.bench_structured_output [--write-doc] [--skip-engine]

Micro (both libraries, the demo model's tokenizer (vocab 49,152) and the bench model's (32,000)):
- compile a 10-field schema cold (a fresh compiler each time, no cache) and cached (shardserve's LRU);
- fill the next-token bitmask of 50 matchers, each standing somewhere inside a valid document;
- apply a bitmask to 100 × 32,000 float32 logits: the native CPU op, the torch reference, xgrammar's own.
Engine (offline, bench model): 50 prompts of 512 tokens -> at most 128 tokens, constrained (the grammar
ends each answer) against unconstrained with ignore_eos; generated tokens per second, alternated rounds.
With --vllm-python (scripts/setup_peer.sh's venv), vLLM's CPU build runs the same two loads offline, in its
own process, first (xgrammar is its default backend too).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kernels.backend import TORCH, get_backend
from kernels.bitmask import bitmask_words
from scripts.bench_engine import cpu_name
from scripts.doc_blocks import rewrite_block

BEGIN, END = "<!-- structured-output:begin -->", "<!-- structured-output:end -->"

# What an agent's extraction call sends: ten fields, the features clients use.
TEN_FIELD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "joined": {"type": "string", "format": "date"},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "city", "active", "score", "role", "tags", "joined", "address"],
    "additionalProperties": False,
}
SAMPLE_DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "city": "London", "active": True,
    "score": 9.5, "role": "admin", "tags": ["math", "engines"], "joined": "1843-07-01",
    "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"},
}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def xgrammar_case(tokenizer, vocab_size: int, repeats: int) -> dict:
    import xgrammar as xgr

    from engine.config import StructuredOutputsParams
    from engine.structured_output.compiler import GrammarCompiler, json_schema_grammar

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    schema = json.dumps(TEN_FIELD_SCHEMA)
    cold = median_ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(
        json_schema_grammar(schema, compact=False)), repeats)
    ours = GrammarCompiler(tokenizer, vocab_size, (tokenizer.eos_token_id,))
    spec = StructuredOutputsParams(json=TEN_FIELD_SCHEMA)
    compiled = ours.compile(spec)
    cached = median_ms(lambda: ours.submit(spec).result(), repeats * 20)
    ours.shutdown()
    matchers = []
    for position in _positions(tokenizer, 50):
        matcher = xgr.GrammarMatcher(compiled)
        for token in position:
            assert matcher.accept_token(token)
        matchers.append(matcher)
    bitmask = torch.empty(50, bitmask_words(vocab_size), dtype=torch.int32)

    def fill():
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    return {"cold": cold, "cached": cached, "fill50": median_ms(fill, repeats)}


def llguidance_case(tokenizer, vocab_size: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(TEN_FIELD_SCHEMA))
    cold = median_ms(lambda: llguidance.LLMatcher(ll_tokenizer, grammar), repeats)
    matchers = []
    for position in _positions(tokenizer, 50):
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        assert matcher.consume_tokens(position), matcher.get_error()
        matchers.append(matcher)
    bitmask = llguidance.torch.allocate_token_bitmask(50, ll_tokenizer.vocab_size)

    def fill():
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)

    # llguidance compiles lazily, as the matcher walks: there is no separate cached compile to time
    return {"cold": cold, "cached": float("nan"), "fill50": median_ms(fill, repeats)}


def _positions(tokenizer, count: int) -> list[list[int]]:
    """Token prefixes of the sample document, cut at spread-out points (inside strings, numbers, keys)."""
    tokens = tokenizer.encode(json.dumps(SAMPLE_DOCUMENT), add_special_tokens=False)
    rng = random.Random(0)
    return [tokens[: rng.randrange(1, len(tokens))] for _ in range(count)]


def mask_apply_rows(repeats: int) -> list[str]:
    import xgrammar as xgr

    batch, vocab = 100, 32000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_words(vocab)), dtype=torch.int32, generator=generator)
    rows = torch.arange(batch)
    native = get_backend("cpu", "cpu")
    results = {
        "native (kernels/cpu/bitmask.cpp)": lambda: native.apply_token_bitmask(logits.clone(), bitmask, rows),
        "torch reference": lambda: TORCH.apply_token_bitmask(logits.clone(), bitmask, rows),
        "xgrammar's apply_token_bitmask_inplace": lambda: xgr.apply_token_bitmask_inplace(logits.clone(), bitmask),
        "the logits copy alone": lambda: logits.clone(),
    }
    for fn in results.values():
        fn()
    return [f"| {name} | {median_ms(fn, repeats):.3f} |" for name, fn in results.items()]


def engine_rates(rounds: int) -> dict[str, list[float]]:
    from engine import LLM, SamplingParams
    from engine.checkpoint.random_model import ensure_bench_model
    from engine.config import StructuredOutputsParams

    llm = LLM(model=str(ensure_bench_model()), dtype="float32", max_num_seqs=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(512)] for _ in range(50)]
    # unseeded, as vLLM's run must be (below)
    free = SamplingParams(max_tokens=128, ignore_eos=True)
    constrained = SamplingParams(max_tokens=128, structured_outputs=StructuredOutputsParams(json=TEN_FIELD_SCHEMA))
    llm.generate(prompts[:4], [free, constrained] * 2)  # warm-up (and the grammar's compile)
    rates: dict[str, list[float]] = {"unconstrained": [], "10-field JSON schema": []}
    for _ in range(rounds):
        for name, params in (("unconstrained", free), ("10-field JSON schema", constrained)):
            prompts = [[rng.randrange(3, 32000) for _ in range(512)] for _ in range(50)]  # no prefix-cache hits
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    llm.shutdown()
    return rates


def rate_rows(engine: str, rates: dict[str, list[float]]) -> list[str]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["10-field JSON schema"] / medians["unconstrained"]
    return [f"| {engine} | {name} | {medians[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |"
            + (f" {ratio:.2f}× |" if name != "unconstrained" else " |")
            for name, values in rates.items()]


_VLLM_CONSTRAINED = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams
args = json.load(open(sys.argv[1]))
llm = LLM(model=args["model"], dtype="float32", max_model_len=1024, enable_prefix_caching=False, max_num_seqs=64)
# unseeded: vLLM's CPU worker dies on seeded constrained requests ("CPU Generator does not use offset")
free = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)
constrained = SamplingParams(temperature=1.0, max_tokens=128,
                             structured_outputs=StructuredOutputsParams(json=args["schema"]))
llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["rounds"][0][:4]], [free, constrained] * 2, use_tqdm=False)
rates = {"unconstrained": [], "10-field JSON schema": []}
for prompts in args["rounds"]:
    for name, params in (("unconstrained", free), ("10-field JSON schema", constrained)):
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
print("RESULT " + json.dumps(rates), flush=True)
"""


def vllm_engine_rates(vllm_python: str, rounds: int) -> dict[str, list[float]]:
    """vLLM's offline tok/s on the same loads (its own process, as scripts/bench_peer.py runs it)."""
    from engine.checkpoint.random_model import ensure_bench_model
    from scripts.bench_peer import _tcmalloc, offline_run
    from scripts.bench_serve import REPO, VLLM_VERSION_SHIM, vllm_cpu_env

    rng = random.Random(1)
    arguments = {"model": str(ensure_bench_model()), "schema": TEN_FIELD_SCHEMA,
                 "rounds": [[[rng.randrange(3, 32000) for _ in range(512)] for _ in range(50)] for _ in range(rounds)]}
    env = vllm_cpu_env(vllm_python, _tcmalloc(vllm_python))
    return offline_run([vllm_python, "-c", VLLM_VERSION_SHIM + _VLLM_CONSTRAINED], arguments, env, REPO)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--vllm-python", help="the peer's python (scripts/setup_peer.sh) for the side by side")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    from engine.checkpoint.demo import ensure_demo_model
    from engine.checkpoint.loader import load_tokenizer
    from engine.checkpoint.random_model import ensure_bench_model

    tokenizers = {"demo (SmolLM2, 49,152)": (load_tokenizer(str(ensure_demo_model())), 49152),
                  "bench (BPE, 32,000)": (load_tokenizer(str(ensure_bench_model())), 32000)}
    library_rows = []
    for label, (tokenizer, vocab) in tokenizers.items():
        for library, case in (("xgrammar", xgrammar_case), ("llguidance", llguidance_case)):
            r = case(tokenizer, vocab, args.repeats)
            library_rows.append(f"| {label} | {library} | {r['cold']:.1f} | {r['cached']:.4f} | {r['fill50']:.2f} |")
            print(library_rows[-1], flush=True)
    apply_rows = mask_apply_rows(args.repeats * 3)
    print(*apply_rows, sep="\n", flush=True)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {cpu_name()}, "
        f"{torch.get_num_threads()} torch threads, median of {args.repeats} runs.",
        "",
        "Grammar libraries on the same 10-field JSON schema (milliseconds): compile cold; compile when cached "
        "(shardserve's LRU; llguidance compiles lazily as it matches, so it has none); filling the bitmask of 50 "
        "matchers standing inside a document.",
        "",
        "| tokenizer | library | compile cold | cached | fill 50 rows |",
        "|---|---|---|---|---|",
        *library_rows,
        "",
        "Applying a bitmask to 100 × 32,000 float32 logits (milliseconds, each including a copy of the logits):",
        "",
        "| implementation | ms |",
        "|---|---|",
        *apply_rows,
    ]
    if not args.skip_engine:
        rows = rate_rows("vLLM CPU", vllm_engine_rates(args.vllm_python, args.rounds)) if args.vllm_python else []
        shardserve = engine_rates(args.rounds)
        rows += rate_rows("shardserve", shardserve)
        print(*rows, sep="\n", flush=True)
        lines += [
            "",
            "Offline engine, bench model in float32, 50 prompts × 512 tokens -> at most 128 tokens, sampled at "
            "temperature 1; the constrained answers end where the grammar ends them, the free ones run to 128 "
            f"(ignore_eos). Generated tokens per second, {args.rounds} alternated rounds"
            + (", vLLM's CPU build first, in its own process:" if args.vllm_python else ":"),
            "",
            "| engine | load | tok/s (median) | rounds | constrained / free |",
            "|---|---|---|---|---|",
            *rows,
        ]
    peer = ' --vllm-python "$(bash scripts/setup_peer.sh)"' if args.vllm_python else ""
    lines += ["", f"Command: `python -m scripts.bench_structured_output{peer} --write-doc` (in `make bench`)"]
    if args.write_doc:
        rewrite_block(BEGIN, END, "\n".join(lines), "Structured outputs")


if __name__ == "__main__":
    main()
