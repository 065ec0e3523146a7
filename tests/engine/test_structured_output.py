"""Structured outputs in the engine: every constrained output matches its constraint, greedy output equals
transformers' under xgrammar's own logits processor, and unconstrained requests never notice."""

import gc
import json
import logging
import random

import jsonschema
import pytest
import xgrammar as xgr
from grammar_oracle import hf_constrained_greedy

from engine import LLM, SamplingParams
from engine.config import EngineConfig, StructuredOutputsParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.structured_output.grammar import num_live_matchers

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

# The schema features agent clients send; random weights produce valid output only through the mask.
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                                "additionalProperties": False}},
        "required": ["user"],
        "additionalProperties": False,
    },
    "array bounds": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]},
    "integer bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
                       "required": ["n"], "additionalProperties": False},
    "pattern and format": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                       "day": {"type": "string", "format": "date"}},
        "required": ["code", "day"],
        "additionalProperties": False,
    },
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
              "required": ["v"], "additionalProperties": False},
    "optional fields": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
                                                                                          "maxLength": 4}},
                        "required": ["a"], "additionalProperties": False},
}


def random_prompts(lengths, seed=0, vocab=1000):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def json_params(schema=PERSON, max_tokens=400, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema), **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32")


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 32},  # chunked prefill, prefills sharing steps with constrained decodes
    {"num_kv_blocks": 12, "max_model_len": 192},  # preemption by recompute mid-grammar
    {"num_kv_blocks": 12, "max_model_len": 192, "preemption_mode": "swap", "swap_space": 0.05},
    {"max_num_batched_tokens": 32, "overlapped_fill": True},
], ids=["plain", "chunked", "recompute", "swap", "chunked-fill-beside-the-pass"])
def test_constrained_greedy_equals_transformers_under_the_same_grammar(tiny_llama_dir, hf_greedy, engine_args,
                                                                       monkeypatch):
    prompts = random_prompts([20, 45, 70, 33], seed=4)
    engine_args = dict(engine_args)
    # the bitmask filled on its thread while the forward pass runs (a GPU's way, or a CPU's with a spare core),
    # rather than before the pass, as on these 2 cores
    overlapped = engine_args.pop("overlapped_fill", False)
    monkeypatch.setattr("engine.llm_engine.overlaps_bitmask_fill", lambda config: overlapped)
    engine_llm = LLM(model=str(tiny_llama_dir), dtype="float32", **engine_args)
    assert (engine_llm.engine._bitmask_filler is not None) == overlapped
    expected = hf_constrained_greedy(hf_greedy, tiny_llama_dir, engine_llm.get_tokenizer(), prompts, PERSON, 40)
    assert len({tuple(e) for e in expected}) == len(expected), "oracle outputs should differ per prompt"
    got = [o.outputs[0].token_ids for o in engine_llm.generate(prompts, json_params(max_tokens=40))]
    assert got == expected
    if "num_kv_blocks" in engine_args:
        mode = engine_args.get("preemption_mode", "recompute")
        assert engine_llm.engine.scheduler.num_preemptions_by_mode[mode] > 0, "the pool was large enough"
    if "max_num_batched_tokens" in engine_args:
        assert engine_llm.engine.num_mixed_steps > 0
    # a prefix-cache hit on the second round changes nothing either
    again = [o.outputs[0].token_ids for o in engine_llm.generate(prompts, json_params(max_tokens=40))]
    assert engine_llm.engine.scheduler.prefix_cache_hits > 0
    assert again == expected
    engine_llm.engine.scheduler.block_manager.check_all_free()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema_greedy_and_sampled(llm, name):
    schema = SCHEMAS[name]
    prompts = random_prompts([8, 30], seed=len(name))
    params = [json_params(schema), json_params(schema, temperature=1.0, top_p=0.95, seed=7)]
    for output in llm.generate(prompts * 2, params * 2):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("constraint, check", [
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: len(text) == 6 and text[3] == "-" and text[:3].isdigit()),
    ({"choice": ["yes", "no", "maybe so"]}, lambda text: text in ("yes", "no", "maybe so")),
    ({"grammar": 'root ::= "(" [a-c]+ ")"'}, lambda text: text[0] == "(" and text[-1] == ")" and set(text[1:-1]) <= set("abc")),
])
def test_each_kind_of_constraint_holds_when_sampled(llm, constraint, check):
    spec = StructuredOutputsParams(**constraint)
    params = SamplingParams(temperature=1.0, max_tokens=300, structured_outputs=spec)
    for output in llm.generate(random_prompts([5, 12, 40], seed=2), params):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert check(completion.text), completion.text
        else:  # any JSON object may nest deeper than max_tokens: what came is a prefix of one
            assert "json_object" in constraint and completion.finish_reason == "length"
            matcher = xgr.GrammarMatcher(llm.engine.grammar_compiler.compile(spec))
            assert matcher.accept_string(completion.text) and not matcher.is_terminated()


def test_fifty_mixed_requests_each_get_what_they_asked_for(llm):
    prompts = random_prompts([random.Random(i).randrange(5, 60) for i in range(50)], seed=50)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seeded = json_params(temperature=0.8, seed=11)
    params = [free if i % 2 else json_params() for i in range(49)] + [seeded]
    outputs = llm.generate(prompts, params)
    alone_free = llm.generate([prompts[i] for i in range(1, 49, 2)], free)
    assert [outputs[i].outputs[0].token_ids for i in range(1, 49, 2)] == [o.outputs[0].token_ids for o in alone_free]
    for i in range(0, 50, 2):
        jsonschema.validate(json.loads(outputs[i].outputs[0].text), PERSON)
    # a seeded constrained request draws the same tokens alone as in the batch of 50
    assert llm.generate([prompts[49]], seeded)[0].outputs[0].token_ids == outputs[49].outputs[0].token_ids


def test_n_choices_each_have_their_own_matcher(llm):
    [output] = llm.generate(random_prompts([10]), json_params(temperature=1.0, n=3, seed=5))
    texts = [c.text for c in output.outputs]
    assert len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_length_cut_ends_with_length_and_a_stop_string_with_stop(llm):
    [cut] = llm.generate(random_prompts([10]), json_params(max_tokens=5))
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 5
    [full] = llm.generate(random_prompts([10]), json_params())
    stop = full.outputs[0].text[3:6]
    [stopped] = llm.generate(random_prompts([10]), json_params(stop=[stop]))
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert full.outputs[0].text.startswith(stopped.outputs[0].text)


def test_logit_bias_forces_and_bans_tokens(llm):
    prompt = random_prompts([12], seed=9)
    [plain] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    first = plain.outputs[0].token_ids[0]
    [banned] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={first: -100}))
    assert first not in banned.outputs[0].token_ids
    [forced] = llm.generate(prompt, SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, seed=1,
                                                   logit_bias={77: 100}))
    assert forced.outputs[0].token_ids == [77] * 6


@pytest.mark.parametrize("constraint, message", [
    ({"json": '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'}, "json constraint cannot be compiled"),
    ({"json": "{not json"}, "json constraint cannot be compiled"),
    ({"regex": "[0-9"}, "regex constraint cannot be compiled"),
    ({"grammar": "root ::= undefined_rule"}, "grammar constraint cannot be compiled"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_keeps_serving(tiny_llama_dir, constraint,
                                                                                    message):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    engine.add_request("ok", [5, 6, 7], json_params(max_tokens=30))
    with pytest.raises(InvalidRequestError, match=message) as error:
        engine.add_request("bad", [5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert error.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("bias", [5], SamplingParams(logit_bias={10**6: 1.0}))
    finished = []
    while engine.has_unfinished_requests():
        finished += [d for d in engine.step() if d.finished]
    assert [d.request_id for d in finished] == ["ok"]
    engine.scheduler.block_manager.check_all_free()
    assert engine.grammar_compiler.compile(StructuredOutputsParams(regex="a+")) is not None
    engine.shutdown()


def test_finished_and_aborted_requests_leave_no_matcher_or_block_behind(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    gc.collect()  # earlier tests' finished requests
    before = num_live_matchers()
    engine.add_request("done", [3, 4], json_params(max_tokens=20))
    engine.add_request("aborted", [3, 4, 5], json_params(max_tokens=200, n=2))
    engine.step()
    engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.block_manager.check_all_free()
    engine.shutdown()
    del engine
    gc.collect()
    assert num_live_matchers() == before


def test_a_cached_constraint_compiles_once(llm):
    compiler = llm.engine.grammar_compiler
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    first = compiler.submit(spec)
    first.result()
    again = compiler.submit(StructuredOutputsParams(json={"properties": {"k": {"type": "integer"}}, "type": "object"}))
    assert again is first and again.done()  # the same schema, keys in another order: the cached grammar


@pytest.fixture
def four_cores(monkeypatch):
    """This process may run on 4 cores (allowed_cores reads its affinity once: read again, and after the test)."""
    from engine.cpu_binding import allowed_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)), raising=False)
    allowed_cores.cache_clear()
    yield
    monkeypatch.undo()
    allowed_cores.cache_clear()


def test_the_bitmask_is_filled_beside_the_forward_pass_only_where_a_core_is_free(four_cores):
    from engine.llm_engine import overlaps_bitmask_fill

    assert not overlaps_bitmask_fill(EngineConfig(model="x", device="cpu"))  # every core runs the pass
    assert overlaps_bitmask_fill(EngineConfig(model="x", device="cpu", cpu_threads=3))
    assert not overlaps_bitmask_fill(EngineConfig(model="x", device="cpu", cpu_threads=2, tensor_parallel_size=2))
    assert overlaps_bitmask_fill(EngineConfig(model="x", device="cuda"))  # the host only launches kernels
    # bound ranks: a core no rank's list has (the control plane's, app/cpu_placement.py)
    assert overlaps_bitmask_fill(EngineConfig(model="x", device="cpu", cpu_threads_bind="0-2"))
    assert not overlaps_bitmask_fill(EngineConfig(model="x", device="cpu", cpu_threads_bind="0-1|2-3",
                                                  tensor_parallel_size=2))


# a JSON document with free text in it: the looping model repeats itself inside the strings, where n-gram
# proposals get accepted, and the grammar cuts those that would leave the string or the schema
NOTES = {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
         "required": ["title", "body"], "additionalProperties": False}
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 32},
    # rank 0 masks and samples every verified row; both ranks' shards compute the chunk (Ray actors over gloo)
    {"max_num_batched_tokens": 32, "tensor_parallel_size": 2},
], ids=["plain", "chunked", "chunked-tp2"])
def test_speculative_constrained_greedy_equals_transformers_under_the_same_grammar(tiny_llama_looping_dir, hf_greedy,
                                                                                   engine_args):
    prompts = random_prompts([20, 45, 70, 33], seed=5)
    engine_llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=SPECULATIVE,
                     enable_prefix_caching=False, **engine_args)
    try:
        expected = hf_constrained_greedy(hf_greedy, tiny_llama_looping_dir, engine_llm.get_tokenizer(), prompts,
                                         NOTES, 48)
        got = [o.outputs[0].token_ids for o in engine_llm.generate(prompts, json_params(NOTES, max_tokens=48))]
        assert got == expected
        spec = engine_llm.engine.scheduler.spec_stats
        # proposals were verified under the mask, some accepted and some rejected
        assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_proposed_tokens, spec
        engine_llm.engine.scheduler.block_manager.check_all_free()
    finally:
        engine_llm.shutdown()


def test_proposals_are_cut_to_the_run_the_grammar_accepts_and_the_matcher_stays_put(llm):
    from engine.structured_output.grammar import SequenceGrammar

    tokenizer = llm.get_tokenizer()
    grammar = SequenceGrammar(llm.engine.grammar_compiler.compile(StructuredOutputsParams(json=NOTES)))
    document = tokenizer.encode('{"title": "a", "body": "b"}', add_special_tokens=False)
    assert grammar.valid_prefix(document) == len(document)  # a whole document, its end not proposed
    assert grammar.valid_prefix([*document[:3], tokenizer.encode("}", add_special_tokens=False)[0]]) == 3
    for token in document:  # nothing was left accepted by the checks above
        assert grammar.accept(token)
    eos = tokenizer.eos_token_id
    assert grammar.valid_prefix([eos]) == 0  # the token that would end the grammar is not proposed
    assert not grammar.is_terminated


class _ProposesPastTheGrammar:
    """Proposes what a plain greedy run emitted next (the target accepts it), then a token the grammar refuses, then
    the plain run again: as a proposer would if valid_prefix did not cut its runs. Near the end, its run holds the
    grammar's last token and the EOS that ends it before the refused one."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], refused: int):
        self.expected = expected
        self.refused = refused

    def propose(self, seqs, max_proposals):
        runs = []
        for seq, limit in zip(seqs, max_proposals):
            plain = self.expected[tuple(seq.request.prompt_token_ids)][seq.num_output_tokens :]
            runs.append((plain[:2] + [self.refused] + plain[2:])[:limit])
        return runs

    def forget(self, seq):
        pass


def test_proposals_outside_the_grammar_change_no_token_and_end_no_request(llm, tiny_llama_dir, monkeypatch, caplog):
    """Rows verified after a proposal the grammar refuses (or after its end) cannot be masked as their position;
    they are masked as before it and never emitted, so every output is the plain run's and no step fails."""
    from engine.structured_output.grammar import SequenceGrammar

    tokenizer = llm.get_tokenizer()
    refused = tokenizer.encode("7", add_special_tokens=False)[0]
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{12,40}\."))
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts([9, 30, 17, 44, 23], seed=8)
    params = [constrained, free, constrained, constrained, free]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len({tuple(e) for e in expected}) == len(expected)

    speculating = LLM(model=str(tiny_llama_dir), dtype="float32", speculative_config=SPECULATIVE)
    scheduler = speculating.engine.scheduler
    scheduler.proposer = _ProposesPastTheGrammar(dict(zip(map(tuple, prompts), expected)), refused)
    monkeypatch.setattr(SequenceGrammar, "valid_prefix", lambda self, proposals: len(proposals))
    gc.collect()
    matchers_before = num_live_matchers()
    with caplog.at_level(logging.ERROR, logger="shardserve.engine"):
        outputs = speculating.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop", "length", "stop", "stop", "length"]
    # the refused token and the grammar's end were both proposed mid-run, and the plain run's tokens accepted
    followed_past = {record.args[0] for record in caplog.records if "outside the grammar" in record.getMessage()}
    assert followed_past == {refused, tokenizer.eos_token_id}
    assert scheduler.spec_stats.acceptance_length_counts[2] > 0, scheduler.spec_stats
    scheduler.block_manager.check_all_free()
    del outputs
    gc.collect()
    assert num_live_matchers() == matchers_before
