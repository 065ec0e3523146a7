"""scripts/bench_peer.py: every run gets its own prompts, and the table pairs each shardserve row with vLLM's."""

from scripts.bench_peer import MODES, Row, run_seed, table


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
