"""Speculative decoding (engine/spec_decode/): the n-gram proposer, scheduling and rollback with exact block ids,
the verifier's rows and its distribution, seeded reproducibility, aborts, start-up errors and metrics.

Greedy exactness against transformers is in test_hf_equivalence.py, TP=2 in tests/parallel/test_tp_exactness.py.
"""

import itertools
import random

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from scheduler_steps import scheduler_with_fixed_tokens

from engine import LLM, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig, StructuredOutputsParams
from engine.sampler import SampledToken, sample
from engine.scheduler import Scheduler
from engine.sequence import Request
from engine.spec_decode.ngram import NgramProposer, propose_ngram
from engine.spec_decode.verify import SpeculativeRow, num_accepted, sampling_rows
from engine.stopping import StopChecker
from kernels.backend import get_backend

SPECULATIVE = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def arrays(*sequences):
    return [np.asarray(s, dtype=np.int32) for s in sequences]


# ---- the n-gram proposer ----------------------------------------------------------------------------------


def test_the_longest_suffix_match_wins_and_what_followed_it_is_proposed():
    # suffix [7, 8, 9]: "8 9" also occurs later (followed by 4), but "7 8 9" (followed by 1 2) is longer
    tokens = [7, 8, 9, 1, 2, 3, 8, 9, 4, 5, 7, 8, 9]
    assert propose_ngram(arrays(tokens), [2], 1, 3) == [[1, 2]]
    assert propose_ngram(arrays(tokens), [2], 1, 2) == [[4, 5]]  # at most 2: the latest "8 9" wins


def test_among_equally_long_matches_the_latest_is_taken_and_proposals_stop_at_the_end():
    tokens = [5, 6, 1, 5, 6, 2, 3, 5, 6]
    assert propose_ngram(arrays(tokens), [4], 1, 2) == [[2, 3, 5, 6]]
    assert propose_ngram(arrays([4, 4, 4]), [5], 1, 3) == [[4]]  # the match just before the end: one token


def test_nothing_is_proposed_below_prompt_lookup_min_or_without_a_match():
    assert propose_ngram(arrays([1, 2, 3, 9, 3]), [3], 2, 3) == [[]]  # only "3" matches: shorter than 2
    assert propose_ngram(arrays([1, 2, 3, 4]), [3], 1, 3) == [[]]
    assert propose_ngram(arrays([1, 2, 1, 2]), [0], 1, 3) == [[]]  # no room for proposals


def reference_proposal(tokens, k, min_n, max_n):
    """The rule, one n at a time, longest first, latest occurrence first."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_the_batched_search_agrees_with_the_rule_on_random_sequences():
    rng = random.Random(3)
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(1, 80))] for _ in range(300)]
    ks = [rng.randrange(0, 6) for _ in seqs]
    got = propose_ngram(arrays(*seqs), ks, 2, 4)
    assert got == [reference_proposal(s, k, 2, 4) if k else [] for s, k in zip(seqs, ks)]
    assert sum(map(bool, got)) > 100


def test_the_proposer_follows_growing_sequences():
    request = Request("r", None, [1, 2, 3, 1, 2], SamplingParams())
    (seq,) = request.seqs
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([seq], [3]) == [[3, 1, 2]]
    seq.append_token(9, None)
    assert proposer.propose([seq], [3]) == [[]]
    seq.append_token(1, None)
    assert proposer.propose([seq], [1]) == [[2]]


# ---- scheduling and rollback (no model: every sampled token is given) -------------------------------------


def spec_scheduler(num_blocks=16, prefix_caching=False, **spec):
    config = EngineConfig(model="unused", block_size=4, max_num_batched_tokens=64, watermark=0.0,
                          enable_prefix_caching=prefix_caching,
                          speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 3, **spec})
    return scheduler_with_fixed_tokens(config, num_blocks)


def add(scheduler, prompt, max_tokens=16):
    (seq,) = Request(f"r{random.random()}", None, prompt, SamplingParams(max_tokens=max_tokens)).seqs
    scheduler.add(seq)
    return seq


def step(scheduler, out, tokens):
    scheduler.update_from_output(out, [SampledToken(t, None) for t in tokens])


def prefilled(scheduler, prompt, first_token, **kw):
    seq = add(scheduler, prompt, **kw)
    step(scheduler, scheduler.schedule(), [first_token])
    return seq


def test_a_sequence_with_k_proposals_is_one_chunk_of_k_plus_one_tokens_all_sampled():
    scheduler = spec_scheduler()
    seq = prefilled(scheduler, [5, 6, 7, 5, 6, 7, 5], 6)  # tokens ... 7 5 6: "7 5 6" was followed by 7 5 6
    out = scheduler.schedule()
    (chunk,) = out.prefills
    assert (chunk.num_tokens, chunk.proposals, chunk.token_ids) == (4, [7, 5, 6], [6, 7, 5, 6])
    assert out.num_batched_tokens == 4
    assert [type(row) for row in out.sampling_rows] == [type(seq)] + [SpeculativeRow] * 3
    assert seq.block_table == [0, 1, 2]  # positions 7..10
    step(scheduler, out, [7, 5, 6, 9])  # all three accepted, and the target's own token after them
    assert seq.token_ids[-4:] == [7, 5, 6, 9]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 11
    assert scheduler.spec_stats.acceptance_length_counts == [0, 0, 0, 1]


def test_rejected_proposals_roll_back_computed_tokens_and_the_blocks_only_they_needed():
    scheduler = spec_scheduler()
    seq = prefilled(scheduler, [5, 6, 7, 5, 6, 7, 5], 6)
    out = scheduler.schedule()
    assert seq.block_table == [0, 1, 2]
    step(scheduler, out, [8, 5, 6, 9])  # the first proposal (7) is rejected: only the target's 8 is kept
    assert seq.token_ids[-2:] == [6, 8]
    assert seq.num_computed_tokens == 8
    assert seq.block_table == [0, 1]  # block 2 held only rejected slots
    assert scheduler.block_manager.num_free_blocks == 14
    spec = scheduler.spec_stats
    assert (spec.num_proposed_tokens, spec.num_accepted_tokens, spec.num_emitted_tokens) == (3, 0, 1)
    scheduler.block_manager.check_invariants([seq])


class AlwaysProposes:
    """A proposer that proposes 1, 2, 3 for every sequence: the scheduler's back-off is what is tested."""

    def propose(self, seqs, max_proposals):
        return [[1, 2, 3][:limit] for limit in max_proposals]

    def forget(self, seq):
        pass


def test_a_sequence_whose_proposals_keep_missing_pauses_them_and_one_hit_resumes():
    config = EngineConfig(model="unused", block_size=4, max_num_batched_tokens=64, watermark=0.0,
                          enable_prefix_caching=False,
                          speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    scheduler = Scheduler(config, 64, 0, StopChecker((), 1 << 20, None), proposer=AlwaysProposes())
    seq = prefilled(scheduler, [5, 6, 7], 5, max_tokens=200)

    def one_step(follows: bool) -> bool:
        out = scheduler.schedule()
        (chunk,) = out.chunks
        step(scheduler, out, [1, 2, 3, 4] if follows and chunk.proposals else [9] * (1 + len(chunk.proposals)))
        return bool(chunk.proposals)

    proposed = [one_step(follows=False) for _ in range(14)]  # the target never follows
    # 2 misses, a pause of 1 output token, a miss, a pause of 2, a miss, 4, a miss, 8 ...
    assert proposed == [True, True, False, True, False, False, True] + [False] * 4 + [True, False, False]
    assert seq.spec_misses == 5
    while not one_step(follows=True):  # the paused sequence's next verification keeps all three
        pass
    assert seq.spec_misses == 0 and seq.token_ids[-4:] == [1, 2, 3, 4]
    assert [one_step(follows=False) for _ in range(3)] == [True, True, False]  # the back-off starts over
    scheduler.block_manager.check_invariants([seq])


def test_proposals_are_never_hashed_for_the_prefix_cache_until_accepted():
    scheduler = spec_scheduler(prefix_caching=True)
    seq = prefilled(scheduler, [5, 6, 7, 5, 6, 7, 5], 6)
    out = scheduler.schedule()  # block 1 (positions 4..7) is full of real tokens, block 2 only of proposals
    manager = scheduler.block_manager
    assert manager.block_hash[seq.block_table[1]] is not None
    assert manager.block_hash[seq.block_table[2]] is None
    step(scheduler, out, [7, 9, 0, 0])
    scheduler.schedule()  # the accepted 7 and the target's 9 complete no block yet
    assert manager.block_hash[seq.block_table[2]] is None
    manager.check_invariants([seq])


def test_proposals_never_pass_max_tokens_and_a_stop_inside_an_accepted_run_cuts_there():
    scheduler = spec_scheduler()
    seq = prefilled(scheduler, [5, 6, 7, 5, 6, 7, 5], 6, max_tokens=3)
    out = scheduler.schedule()
    assert out.prefills[0].proposals == [7]  # 1 output, 3 allowed: one proposal and the target's token
    step(scheduler, out, [7, 5])
    assert seq.is_finished and seq.finish_reason == "length" and seq.output_token_ids == [6, 7, 5]
    scheduler.block_manager.check_all_free()


class _GrammarAcceptingOne:
    """A matcher whose grammar accepts only the first of any run of proposals."""

    def valid_prefix(self, proposals):
        return min(1, len(proposals))


def test_speculation_is_off_above_disable_by_batch_size_and_cut_to_what_a_grammar_accepts():
    scheduler = spec_scheduler(disable_by_batch_size=1)
    a, b = add(scheduler, [5, 6, 7, 5, 6, 7, 5]), add(scheduler, [1, 2, 1, 2, 1])
    step(scheduler, scheduler.schedule(), [6, 2])  # both would propose; two are running
    out = scheduler.schedule()
    assert [c.seq for c in out.decodes] == [a, b] and not out.prefills
    scheduler = spec_scheduler()
    seq = prefilled(scheduler, [5, 6, 7, 5, 6, 7, 5], 6)
    seq.grammar = _GrammarAcceptingOne()  # the n-gram match would propose [7, 5, 6]
    out = scheduler.schedule()
    assert not out.decodes and out.sampled_proposals == [[7]]


def test_proposals_are_cut_to_the_token_budget():
    config = EngineConfig(model="unused", block_size=4, max_num_batched_tokens=3, watermark=0.0,
                          enable_prefix_caching=False,
                          speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    scheduler = scheduler_with_fixed_tokens(config, 16)
    add(scheduler, [5, 6, 7, 5, 6, 7, 5])
    for _ in range(2):  # the prompt in chunks of 3, 3 and 1
        step(scheduler, scheduler.schedule(), [])
    step(scheduler, scheduler.schedule(), [6])
    out = scheduler.schedule()
    assert out.prefills[0].proposals == [7, 5]  # 3 proposed, the budget holds the last token and two
    assert out.num_batched_tokens == 3


# ---- verification rows and the distribution they sample --------------------------------------------------


def seeded_seq(seed, prompt=(3, 4, 5), outputs=(), **params):
    request = Request(f"s{seed}", None, list(prompt), SamplingParams(seed=seed, **params))
    seq = request.seqs[0]
    for token in outputs:
        seq.append_token(token, None)
    return seq


def test_a_speculative_row_samples_as_its_sequence_would_with_the_proposals_appended():
    """Penalties see the proposals, min_tokens counts them, and the draw uses their output position's counter."""
    backend = get_backend("auto", "cpu")
    params = dict(temperature=0.8, top_k=6, repetition_penalty=1.5, frequency_penalty=0.5, min_tokens=3)
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(0)).repeat(50, 1)
    logits[:, 2] = 5.0  # EOS: allowed only from the third output on
    rows, appended = [], []
    for seed in range(50):
        proposals = [7, 8][: seed % 3]
        rows.append(sampling_rows(seeded_seq(seed, outputs=[6], **params), proposals)[-1])
        appended.append(seeded_seq(seed, outputs=[6, *proposals], **params))
    got = [t.token_id for t in sample(logits, rows, (2,), backend)]
    assert got == [t.token_id for t in sample(logits, appended, (2,), backend)]
    assert len(set(got)) > 3


def chi_square_p_value(counts_a: np.ndarray, counts_b: np.ndarray) -> float:
    """Two-sample homogeneity test over the categories either sample saw."""
    table = np.stack([counts_a, counts_b]).astype(np.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def test_verified_tokens_have_the_target_distribution_at_temperature_0_7_and_top_p_0_9():
    """Two positions over a vocabulary of 8: the first emitted token, and the second when the proposal was
    accepted, drawn with speculation (one pass over both rows) and without (token by token, other seeds)."""
    vocab, draws, backend = 8, 20000, get_backend("auto", "cpu")
    generator = torch.Generator().manual_seed(1)
    logits0, logits1 = torch.randn(vocab, generator=generator) * 2, torch.randn(vocab, generator=generator) * 2
    proposal = int(logits0.argsort()[-2])  # the target's second choice: accepted now and then
    params = dict(temperature=0.7, top_p=0.9, repetition_penalty=1.3)

    def outcome(first, second):
        return first if first != proposal else vocab + second  # a category per emitted run

    seqs = [seeded_seq(seed, **params) for seed in range(draws)]
    rows = [row for seq in seqs for row in sampling_rows(seq, [proposal])]
    tokens = [t.token_id for t in sample(torch.stack([logits0, logits1]).repeat(draws, 1), rows, (), backend)]
    with_spec = np.zeros(2 * vocab, dtype=np.int64)
    for i in range(draws):
        first, second = tokens[2 * i], tokens[2 * i + 1]
        assert num_accepted([proposal], [first, second]) == (first == proposal)
        with_spec[outcome(first, second)] += 1

    plain = [seeded_seq(draws + seed, **params) for seed in range(draws)]
    firsts = [t.token_id for t in sample(logits0.repeat(draws, 1), plain, (), backend)]
    for seq, first in zip(plain, firsts):
        seq.append_token(first, None)
    accepted = [seq for seq, first in zip(plain, firsts) if first == proposal]
    seconds = iter(t.token_id for t in sample(logits1.repeat(len(accepted), 1), accepted, (), backend))
    without = np.zeros(2 * vocab, dtype=np.int64)
    for first in firsts:
        without[outcome(first, next(seconds) if first == proposal else 0)] += 1

    assert 0.05 < with_spec[vocab:].sum() / draws < 0.6, "the proposal is almost never or always accepted"
    assert (with_spec[vocab:] > 0).sum() >= 3, "too few second tokens to compare"
    assert chi_square_p_value(with_spec, without) > 1e-3
    # and the test can tell: accepting the proposal regardless of the target shifts the first token
    always = with_spec.copy()
    always[proposal] = 0
    always[vocab + proposal] += with_spec[:vocab].sum() - with_spec[proposal]
    assert chi_square_p_value(always, without) < 1e-6


def test_under_a_grammar_speculation_keeps_the_distribution_at_temperature_0_7_and_top_p_0_9(
        tiny_llama_looping_dir):
    """The regex [0-2][a-c][3-5] on the looping model: 2000 seeded draws with n-gram speculation and 2000
    without (other seeds) give the same 27 outputs in the same proportions. The prompt holds "0 b 4", "1 c 3"
    and "2 a 5", so each first digit gets two proposals (its letter, then a digit). Row 0 chooses among the
    letters, row 1 (after the proposed letter) among 3-5, and row 2 (after both) may only end the grammar."""
    draws = 2000
    llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=SPECULATIVE)
    tokenizer = llm.get_tokenizer()
    first, letter, last = ([tokenizer.encode(c, add_special_tokens=False)[0] for c in chars]
                           for chars in ("012", "abc", "345"))
    sep = tokenizer.encode(";", add_special_tokens=False)[0]
    proposed_letter = {first[0]: letter[1], first[1]: letter[2], first[2]: letter[0]}
    rng = random.Random(5)
    prompt = [rng.randrange(100, 1000) for _ in range(6)]
    for digit, end in zip(first, (last[1], last[0], last[2])):
        prompt += [digit, proposed_letter[digit], end, sep]
    categories = {output: i for i, output in enumerate(itertools.product(first, letter, last))}  # 27
    grammar = StructuredOutputsParams(regex="[0-2][a-c][3-5]")

    def counts(engine, seeds):
        params = [SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, max_tokens=8, seed=seed,
                                 structured_outputs=grammar) for seed in seeds]
        found = np.zeros(len(categories), dtype=np.int64)
        for output in engine.generate([prompt] * len(params), params):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop" and completion.token_ids[3:] == [tokenizer.eos_token_id]
            found[categories[tuple(completion.token_ids[:3])]] += 1
        return found

    with_spec = counts(llm, range(draws))
    spec = llm.engine.stats().speculation
    # proposals were verified, and the row after an accepted one chose both its proposal and another token
    assert spec.acceptance_length_counts[1] > 100 and spec.acceptance_length_counts[2] > 100, spec
    assert spec.num_accepted_tokens < spec.num_proposed_tokens
    llm.engine.scheduler.block_manager.check_all_free()
    without = counts(LLM(model=str(tiny_llama_looping_dir), dtype="float32"), range(draws, 2 * draws))
    assert (with_spec > 0).sum() >= 20, "too few outputs to compare"
    assert chi_square_p_value(with_spec, without) > 1e-3
    # and the test can tell: accepting the proposed letter regardless of the target shifts the letters
    always = np.zeros_like(with_spec)
    for (a, _, c), i in categories.items():
        always[categories[a, proposed_letter[a], c]] += with_spec[i]
    assert chi_square_p_value(always, without) < 1e-6


# ---- the engine -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repeating_prompts():
    """Prompts whose greedy continuations on the looping model fall into loops (as test_hf_equivalence's)."""
    rng = random.Random(59)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (10, 40, 25)]


def test_a_seeded_request_gives_the_same_tokens_alone_in_a_batch_and_without_speculation(tiny_llama_looping_dir,
                                                                                         repeating_prompts):
    params = SamplingParams(temperature=0.05, top_p=0.9, max_tokens=32, ignore_eos=True, seed=11)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=SPECULATIVE)
    alone = llm.generate([repeating_prompts[0]], params)[0].outputs[0].token_ids
    batched = llm.generate(repeating_prompts, [params, other, other])[0].outputs[0].token_ids
    plain = LLM(model=str(tiny_llama_looping_dir), dtype="float32")
    assert alone == batched == plain.generate([repeating_prompts[0]], params)[0].outputs[0].token_ids
    assert llm.engine.stats().speculation.num_accepted_tokens > 0
    llm.engine.scheduler.block_manager.check_all_free()


def test_logprobs_and_n_choices_are_what_they_are_without_speculation(tiny_llama_looping_dir, repeating_prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.05, max_tokens=30, ignore_eos=True, n=2, seed=3, min_tokens=20)]
    prompts = repeating_prompts[:2]
    plain = LLM(model=str(tiny_llama_looping_dir), dtype="float32").generate(prompts, params)
    llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=SPECULATIVE)
    got = llm.generate(prompts, params)
    for want, have in zip(plain, got):
        assert [o.token_ids for o in have.outputs] == [o.token_ids for o in want.outputs]
    for want, have in zip(plain[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert want.keys() == have.keys()
        assert all(abs(want[t] - have[t]) < 1e-4 for t in want)
    assert llm.engine.stats().speculation.num_accepted_tokens > 0


def test_an_abort_while_a_verification_runs_leaks_no_blocks(tiny_llama_looping_dir, repeating_prompts):
    llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=SPECULATIVE)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(repeating_prompts):
        engine.add_request(str(i), prompt, params)
    execute = engine.executor.execute_model
    aborted = []

    def abort_during_verification(step, sampling):
        verifying = sampling is not None and any(isinstance(row, SpeculativeRow) for row in sampling.seqs)
        if verifying and not aborted:
            row = next(row for row in sampling.seqs if isinstance(row, SpeculativeRow))
            aborted.append(engine.abort_request(row.seq.request.request_id))
        return execute(step, sampling)

    engine.executor.execute_model = abort_during_verification
    after_abort = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if aborted:
                after_abort[delta.request_id] = delta
    assert aborted and aborted[0].outputs[0].finish_reason == "abort"
    others = set(map(str, range(len(repeating_prompts)))) - {aborted[0].request_id}
    assert set(after_abort) == others, "the aborted request got a token after its abort"
    assert all(after_abort[r].outputs[0].finish_reason == "length" for r in others)
    engine.scheduler.block_manager.check_all_free()


def test_a_draft_model_with_another_vocabulary_is_refused_at_start_up(tiny_llama_looping_dir, tmp_path):
    import json
    import shutil

    from engine.spec_decode.draft import DraftVocabularyError

    draft = tmp_path / "draft"
    shutil.copytree(tiny_llama_looping_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(DraftVocabularyError, match="vocabulary of 1000 tokens, the target 1024"):
        LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=speculative)


@pytest.mark.parametrize("tokens", [0, 17])
def test_num_speculative_tokens_out_of_bounds_is_a_clear_start_up_error(tiny_llama_dir, tokens):
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        LLM(model=str(tiny_llama_dir), speculative_config={"num_speculative_tokens": tokens})


def test_speculative_config_rules_and_the_serve_flag():
    from app.config import ServeArgs

    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValidationError, match="draft_model needs speculative_config.model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValidationError, match="which method ngram does not take"):
        SpeculativeConfig(num_speculative_tokens=2, model="/some/draft")
    args = ServeArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 5}')
    config = args.engine_config("/model")
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5)
    assert ServeArgs().engine_config("/model").speculative_config is None  # off by default
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        ServeArgs(speculative_config={"num_speculative_tokens": 99})
    with pytest.raises(ValidationError, match="not valid JSON"):
        ServeArgs(speculative_config="{num_speculative_tokens: 2")


def test_prompt_lookup_bounds_resolve_as_vllms_do():
    """vLLM's rule: one bound given, the other equals it; neither, both 5 (the same --speculative-config on
    both servers proposes from the same n-grams)."""
    def bounds(**given):
        config = SpeculativeConfig(num_speculative_tokens=2, **given)
        return config.prompt_lookup_min, config.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=3) == (3, 3)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)
    assert SpeculativeConfig.model_validate({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3


def test_the_serve_flag_takes_vllm_json():
    from app.cli import build_parser, serve_args_from

    flags = ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']
    config = serve_args_from(build_parser().parse_args(flags)).engine_config("/model").speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 2)
    assert config.prompt_lookup_min == 2


def test_metrics_report_proposed_accepted_and_emitted_tokens(tiny_llama_looping_dir, repeating_prompts):
    from prometheus_client import CollectorRegistry, generate_latest

    from app.observability.metrics import EngineCollector

    llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=SPECULATIVE)
    llm.generate(repeating_prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    spec = llm.engine.stats().speculation
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.engine, "m", "r0"))
    text = generate_latest(registry).decode()
    labels = '{model_name="m",replica="r0"}'
    assert f"shardserve:spec_decode_num_draft_tokens_total{labels} {float(spec.num_proposed_tokens)}" in text
    assert f"shardserve:spec_decode_num_accepted_tokens_total{labels} {float(spec.num_accepted_tokens)}" in text
    assert f"shardserve:spec_decode_num_emitted_tokens_total{labels} {float(spec.num_emitted_tokens)}" in text
    count = f'shardserve:spec_decode_acceptance_length_count{labels} {float(spec.num_verifications)}'
    assert count in text
    assert spec.num_emitted_tokens == spec.num_accepted_tokens + spec.num_verifications


def test_the_draft_forgets_the_kv_of_proposals_the_target_rejected():
    from engine.spec_decode.draft import _DraftSequence

    (seq,) = Request("d", None, [1, 2, 3, 4, 5], SamplingParams()).seqs
    draft = _DraftSequence(seq)
    draft.base_len, draft.proposals, draft.num_computed_tokens = 5, [7, 8, 9], 7  # K/V of 1..5, 7, 8
    for token in (7, 8, 3):  # the target kept two proposals, then chose 3 over 9
        seq.append_token(token, None)
    draft.roll_back()
    assert (draft.num_computed_tokens, draft.proposals, draft.token_ids) == (7, [], [1, 2, 3, 4, 5, 7, 8, 3])
    draft.base_len, draft.proposals, draft.num_computed_tokens = 8, [6], 8
    seq.append_token(4, None)  # rejected at once: only the K/V of the target's own tokens stays
    draft.roll_back()
    assert draft.num_computed_tokens == 8
