"""scripts/bench_peer.py: every run gets its own prompts, both clients get the same grounded ones, and the table
pairs each shardserve row with vLLM's."""

import argparse
import json

import pytest

from bench.prompts import load_tokenizer
from bench.run import draw_prompts, prompt_builder
from scripts.bench_peer import MODES, Row, bench_args, main, run_seed, table, vllm_dataset_flags
from scripts.bench_serve import ServerProcess


def test_no_two_runs_share_a_seed_so_no_prompt_is_a_free_prefix_cache_hit():
    seeds = [run_seed(mode, c) for mode in MODES for c in (1, 10, 50, 100)]
    assert len(set(seeds)) == len(seeds)


def test_the_table_gives_shardserve_over_vllm_ratios_at_equal_load():
    rows = [
        Row("vllm bench serve", "sampled", 50, "vllm", 400.0, 1000.0, 100.0),
        Row("vllm bench serve", "sampled", 50, "shardserve", 500.0, 800.0, 80.0),
        Row("vllm bench serve", "greedy", 50, "shardserve", 510.0, 790.0, 79.0),  # no vLLM row: left out
    ]
    offline = {"vllm": {"greedy": 400.0, "sampled": 380.0}, "shardserve": {"greedy": 420.0, "sampled": 418.0}}
    text = table(rows, offline)
    assert "| vllm bench serve | sampled | 50 | 400 | 500 | 1.25× | 1000 / 800 | 0.80× | 100.0 / 80.0 | 0.80× |" in text
    assert "| greedy |" not in text.split("| offline")[0]
    assert "| temperature 1.0 | 380 | 418 | 1.10× |" in text


def test_speculation_off_as_the_baseline_sets_shardserve_beside_itself():
    rows = [
        Row("vllm bench serve", "sampled", 10, "off", 200.0, 900.0, 40.0),
        Row("vllm bench serve", "sampled", 10, "shardserve", 250.0, 900.0, 30.0),
        Row("vllm bench serve", "sampled", 10, "vllm", 1.0, 1.0, 1.0),  # not the baseline asked for
    ]
    text = table(rows, {}, baseline="off")
    assert "| off tok/s | on tok/s |" in text
    assert "| vllm bench serve | sampled | 10 | 200 | 250 | 1.25× | 900 / 900 | 1.00× | 40.0 / 30.0 | 0.75× |" in text
    assert text.count("| vllm bench serve |") == 1
    with pytest.raises(SystemExit):  # nothing to compare without a --speculative-config
        main(["--vllm-python", "unused", "--baseline", "speculation-off"])


def _peer_args(dataset_name: str, extra_body: dict | None = None) -> argparse.Namespace:
    return argparse.Namespace(prompt_tokens=96, output_tokens=8, dataset_name=dataset_name, extra_body=extra_body)


def test_the_random_load_keeps_vllms_random_dataset():
    settings = bench_args(ServerProcess("model", port=8123), "/tok", "greedy", 10, 30, _peer_args("random"))
    assert settings.dataset_name == "random" and settings.seed == run_seed("greedy", 10)
    assert vllm_dataset_flags(settings, "/unused") == [
        "--dataset-name", "random", "--random-input-len", "96", "--random-output-len", "8"]


def test_an_extra_body_reaches_shardserve_bench_as_a_dict():
    body = {"response_format": {"type": "json_object"}}
    settings = bench_args(ServerProcess("model", port=8123), "/tok", "sampled", 10, 30, _peer_args("random", body))
    assert settings.extra_body == {"response_format": {"type": "json_object"}}
    assert bench_args(ServerProcess("model", port=8123), "/tok", "sampled", 10, 30,
                      _peer_args("random")).extra_body is None
    with pytest.raises(SystemExit):  # a JSON array is not a body: refused before any server starts
        main(["--vllm-python", "unused", "--extra-body", "[1]"])


def test_the_grounded_load_gives_vllms_client_the_prompts_shardserve_bench_measures(tiny_llama_dir, tmp_path):
    server = ServerProcess(str(tiny_llama_dir), port=8123)
    settings = bench_args(server, str(tiny_llama_dir), "sampled", 10, 5, _peer_args("grounded"))
    flags = vllm_dataset_flags(settings, str(tmp_path))
    path = tmp_path / "grounded.jsonl"
    assert flags == ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "8",
                     "--disable-shuffle"]
    saved = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    builder = prompt_builder(settings, load_tokenizer(str(tiny_llama_dir)))
    warmup, (measured,) = draw_prompts(builder, settings)  # what run_bench(settings) sends, in that order
    assert saved == measured and len(saved) == 5
    assert not set(warmup) & set(saved)


def test_the_doc_is_written_for_the_random_load_only():
    for extra in (["--dataset-name", "grounded"], ["--speculative-config", '{"method": "ngram"}']):
        with pytest.raises(SystemExit):
            main(["--vllm-python", "unused", "--write-doc", *extra])


def test_a_peer_venv_that_cannot_read_custom_datasets_is_named_before_anything_runs(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # a python where `import pandas` fails
    python.chmod(0o755)
    with pytest.raises(SystemExit, match="pip install pandas"):
        main(["--vllm-python", str(python), "--dataset-name", "grounded", "--no-offline"])


def test_a_range_of_prompt_lengths_is_for_vllms_client_on_the_random_load():
    for extra in (["--clients", "vllm,shardserve"], ["--clients", "vllm", "--dataset-name", "grounded"],
                  ["--clients", "vllm", "--write-doc"]):
        with pytest.raises(SystemExit):  # refused before any server starts
            main(["--vllm-python", "unused", "--random-range-ratio", "0.5", *extra])
