"""`shardserve bench` against an OpenAI-compatible fake on 127.0.0.1 that streams SSE exactly like OpenAI."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from bench.cli import main
from bench.client import poisson_arrival_offsets
from bench.grounded import TASKS, GroundedPromptBuilder, stdlib_source_files
from bench.prompts import PromptBuilder, PromptLengthError, load_tokenizer
from bench.run import BenchArgs, run_bench, save_dataset

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_llama_dir) -> str:
    """The tiny Llama's tokenizer (byte-level BPE, ChatML-like template, no BOS added to completions)."""
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory) -> str:
    """A small byte-level BPE tokenizer that adds BOS to every encoding (as Llama 2/3's do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words = "the quick brown fox jumps over lazy dog serving tokens paged cache batch model engine".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    path = tmp_path_factory.mktemp("bench_tokenizer")
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module", params=["adds_bos", "tiny_llama"])
def any_tokenizer(request, bos_tokenizer_dir, tokenizer):
    """Prompt-length tests run on a tokenizer that adds BOS and on one that does not."""
    return load_tokenizer(bos_tokenizer_dir) if request.param == "adds_bos" else tokenizer


class FakeOpenAIServer:
    """/v1/models, /v1/completions and /v1/chat/completions, streamed as OpenAI does, on a free loopback port.

    `api_key`: requests without it get OpenAI's 401. `refuse_every_other`: every second request gets a 503.
    `short_by`: generate that many tokens fewer than max_tokens (a server that ignores ignore_eos).
    `fail_after`: send an error event instead of the rest of the stream after that many tokens.
    `spec_decode_per_request`: serve /metrics with vLLM's speculative decoding counters (two replicas'
    series), which every finished request advances by (drafts, draft tokens, accepted tokens); else no /metrics.
    """

    def __init__(
        self, tokenizer, tokenizer_dir, api_key=None, refuse_every_other=False, short_by=0, fail_after=None,
        spec_decode_per_request=None,
    ):
        self.tokenizer = tokenizer
        self.spec_decode_per_request = spec_decode_per_request
        self.spec_decode_totals = [0, 0, 0]
        self.api_key = api_key
        self.refuse_every_other = refuse_every_other
        self.short_by = short_by
        self.fail_after = fail_after
        self.num_requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        app = FastAPI()
        app.get("/v1/models")(
            lambda: {
                "object": "list",
                "data": [{"id": "fake-model", "object": "model", "owned_by": "test", "root": tokenizer_dir}],
            }
        )
        app.post("/v1/completions")(self._handler("completions"))
        app.post("/v1/chat/completions")(self._handler("chat"))
        if spec_decode_per_request is not None:
            app.get("/metrics")(self._metrics)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:  # readiness poll, not a timing assumption
            assert time.monotonic() < deadline and self.thread.is_alive(), "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def _metrics(self):
        lines = ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts."]
        for name, total in zip(("num_drafts", "num_draft_tokens", "num_accepted_tokens"), self.spec_decode_totals,
                               strict=True):
            lines.append(f"# TYPE vllm:spec_decode_{name} counter")
            # two replicas' series of one total, split unevenly: the client sums over labels
            lines += [f'vllm:spec_decode_{name}_total{{replica="a"}} {total // 3}',
                      f'vllm:spec_decode_{name}_total{{replica="b"}} {total - total // 3}']
        lines.append('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 99999')  # not a total
        return PlainTextResponse("\n".join(lines) + "\n")

    def _handler(self, endpoint):
        async def handle(request: Request):
            self.num_requests += 1
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return _error(401, "Incorrect API key provided.", "invalid_api_key")
            if self.refuse_every_other and self.num_requests % 2 == 0:
                return _error(503, "The server is overloaded; retry later.", "overloaded")
            body = await request.json()
            self.bodies.append(body)
            return StreamingResponse(self._stream(endpoint, body), media_type="text/event-stream")

        return handle

    async def _stream(self, endpoint, body):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if endpoint == "chat":
                prompt_ids = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
                prompt_tokens = len(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
            else:
                prompt_tokens = len(self.tokenizer(body["prompt"])["input_ids"])
            num_tokens = body["max_tokens"] - self.short_by
            base = {"id": "cmpl-1", "created": 0, "model": body["model"]}
            obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

            def chunk(choice_update, finish=None, usage=None, choices=True):
                choice = {"index": 0, "finish_reason": finish, "logprobs": None, **choice_update}
                data = {**base, "object": obj, "choices": [choice] if choices else [], "usage": usage}
                return f"data: {json.dumps(data)}\n\n"

            if endpoint == "chat":
                yield chunk({"delta": {"role": "assistant", "content": ""}})
            for i in range(num_tokens):
                if i == self.fail_after:
                    yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 500}})}\n\n"
                    return
                await asyncio.sleep(0.001)  # a decode step
                text = f" t{i}"
                last = i == num_tokens - 1
                yield chunk(
                    {"delta": {"content": text}} if endpoint == "chat" else {"text": text},
                    finish="length" if last else None,
                )
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": num_tokens,
                    "total_tokens": prompt_tokens + num_tokens,
                }
                yield chunk({}, usage=usage, choices=False)
            if self.spec_decode_per_request is not None:  # counted before the client can see the end
                self.spec_decode_totals = [t + d for t, d in zip(self.spec_decode_totals,
                                                                   self.spec_decode_per_request, strict=True)]
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _error(status, message, code):
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}}, status
    )


def _args(server, **overrides) -> BenchArgs:
    settings = dict(
        base_url=server.base_url,
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        num_prompts=[6],
        concurrency=[3],
        progress=False,
    )
    return BenchArgs(**{**settings, **overrides})


# ---- prompts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompts_are_exactly_the_requested_tokens_as_the_server_counts_them(any_tokenizer, endpoint):
    builder = PromptBuilder(any_tokenizer, 64, endpoint=endpoint, seed=3)
    prompts = builder.build(40)
    assert len(set(prompts)) == 40
    for prompt in prompts:
        if endpoint == "completions":
            assert len(any_tokenizer(prompt)["input_ids"]) == 64
        else:
            ids = any_tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
            assert len(ids["input_ids"]) == 64


def test_distinct_prompts_share_no_leading_block_unless_a_shared_prefix_is_asked_for(any_tokenizer):
    distinct = PromptBuilder(any_tokenizer, 64, seed=0).build(20)
    heads = [tuple(any_tokenizer(p, add_special_tokens=False)["input_ids"][:8]) for p in distinct]
    assert len(set(heads)) == 20

    shared = PromptBuilder(any_tokenizer, 64, shared_prefix_tokens=24, seed=0)
    prompts = shared.build(20)
    assert len(any_tokenizer(shared.prefix, add_special_tokens=False)["input_ids"]) == 24
    assert all(p.startswith(shared.prefix) for p in prompts)
    assert len(set(prompts)) == 20
    assert {len(any_tokenizer(p)["input_ids"]) for p in prompts} == {64}


def test_several_shared_prefixes_each_lead_some_prompts(any_tokenizer):
    builder = PromptBuilder(any_tokenizer, 64, shared_prefix_tokens=24, num_shared_prefixes=4, seed=0)
    assert len(set(builder.prefixes)) == 4
    prompts = builder.build(40)
    leading = [next(i for i, prefix in enumerate(builder.prefixes) if p.startswith(prefix)) for p in prompts]
    assert set(leading) == {0, 1, 2, 3}
    assert {len(any_tokenizer(p)["input_ids"]) for p in prompts} == {64}


def test_same_seed_gives_the_same_prompts(any_tokenizer):
    assert PromptBuilder(any_tokenizer, 48, seed=7).build(5) == PromptBuilder(
        any_tokenizer, 48, seed=7
    ).build(5)
    assert PromptBuilder(any_tokenizer, 48, seed=7).build(5) != PromptBuilder(
        any_tokenizer, 48, seed=8
    ).build(5)


def test_a_prompt_with_no_room_for_content_is_refused(any_tokenizer):
    with pytest.raises(PromptLengthError, match="no room"):
        PromptBuilder(any_tokenizer, 5, endpoint="chat")  # the template alone is longer
    with pytest.raises(PromptLengthError, match="shared_prefix_tokens"):
        PromptBuilder(any_tokenizer, 16, shared_prefix_tokens=16)


# ---- the grounded dataset ---------------------------------------------------------------------------------


def _server_count(tokenizer, endpoint: str, sent: str) -> int:
    """usage.prompt_tokens as a server counts it (the fake server's way, independent of the builder)."""
    if endpoint == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": sent}], add_generation_prompt=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return len(tokenizer(sent)["input_ids"])


def _chat_text(tokenizer, message: str) -> str:
    """What vLLM's custom dataset sends for a message: the chat template applied by the client."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )


@pytest.fixture(scope="module")
def stdlib_text() -> str:
    return "\n".join(path.read_text(errors="replace") for path in stdlib_source_files())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_grounded_prompts_quote_stdlib_code_at_the_token_target_as_the_server_counts_them(
    any_tokenizer, endpoint, stdlib_text
):
    builder = GroundedPromptBuilder(any_tokenizer, 256, endpoint=endpoint, seed=0)
    messages = builder.build(30)
    assert len(set(messages)) == 30
    sent = [builder.render(m) for m in messages]
    assert sent == (messages if endpoint == "chat" else [_chat_text(any_tokenizer, m) for m in messages])
    counts = [_server_count(any_tokenizer, endpoint, text) for text in sent]
    assert counts == [builder.count_tokens(text) for text in sent]  # what the usage check expects
    assert all(abs(count - 256) <= 4 for count in counts), counts
    assert counts.count(256) >= 27, counts  # exact where trimming lands
    tasks = set()
    for message in messages:
        instruction, passage = message.split(":\n\n", 1)
        tasks.add(next(i for i, task in enumerate(TASKS) if task.startswith(instruction.split("`")[0])))
        assert passage.splitlines()[0].strip() in stdlib_text  # a passage of real source
        if "renamed to" in instruction:
            old = instruction.split("`")[1]
            assert passage.count(old) >= 2  # something to rename
    assert tasks == {0, 1, 2}  # repeat, rename, drop comments


def test_grounded_prompts_are_the_same_for_a_seed_and_differ_across_seeds(any_tokenizer):
    def build(seed):
        return GroundedPromptBuilder(any_tokenizer, 256, endpoint="chat", seed=seed).build(6)

    assert build(7) == build(7)
    assert build(7) != build(8)


def test_grounded_prompts_need_a_chat_template_and_room_for_a_passage(tokenizer_dir, tokenizer):
    bare = load_tokenizer(tokenizer_dir)
    bare.chat_template = None
    with pytest.raises(PromptLengthError, match="chat template"):
        GroundedPromptBuilder(bare, 512)
    with pytest.raises(PromptLengthError, match="no room"):
        GroundedPromptBuilder(tokenizer, 20)


def test_the_grounded_dataset_is_a_vllm_flag_value_without_random_only_settings():
    assert bench_settings("--dataset-name", "grounded").dataset_name == "grounded"
    assert bench_settings().dataset_name == "random"
    with pytest.raises(ValidationError, match="shared-prefix-tokens"):
        bench_settings("--dataset-name", "grounded", "--shared-prefix-tokens", "16")
    with pytest.raises(ValidationError, match="save-dataset"):
        bench_settings("--save-dataset", "prompts.jsonl")  # the random dataset: vLLM has its own


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_saved_grounded_dataset_is_what_the_bench_sent_in_vllm_customs_shape(
    tokenizer, tokenizer_dir, tmp_path, endpoint
):
    saved = tmp_path / "grounded.jsonl"
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        argv = [
            "--base-url", server.base_url, "--dataset-name", "grounded", "--endpoint", endpoint,
            "--prompt-tokens", "96", "--output-tokens", "4", "--num-prompts", "2,3", "--concurrency", "1,2",
            "--num-warmups", "1", "--seed", "5", "--save-dataset", str(saved), "--no-progress",
        ]
        assert main(argv) == 0
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    # vLLM's CustomDataset: a "prompt" per line, the user message it applies the chat template to, and an
    # integer "output_tokens" (used with --custom-output-len -1)
    assert [sorted(row) for row in rows] == [["output_tokens", "prompt"]] * 5
    assert all(isinstance(row["prompt"], str) and row["output_tokens"] == 4 for row in rows)
    measured = server.bodies[1:]  # after the warm-up request, which is not in the file
    if endpoint == "chat":
        sent = [b["messages"][0]["content"] for b in measured]
        assert sorted(sent) == sorted(row["prompt"] for row in rows)
    else:  # what vLLM's client sends with --backend vllm: the message in the chat template
        sent = [b["prompt"] for b in measured]
        assert sorted(sent) == sorted(_chat_text(tokenizer, row["prompt"]) for row in rows)
    assert server.bodies[0] not in measured

    without_server = tmp_path / "again.jsonl"
    save_dataset(
        BenchArgs(dataset_name="grounded", endpoint=endpoint, tokenizer=tokenizer_dir, prompt_tokens=96,
                  output_tokens=4, num_prompts=[2, 3], concurrency=[1, 2], warmup=1, seed=5),
        str(without_server),
    )
    assert without_server.read_text() == saved.read_text()


async def test_a_speculating_servers_acceptance_over_each_run_is_printed(tokenizer, tokenizer_dir, capsys):
    # per request: 3 verifications of 4 proposals each, 9 accepted
    with FakeOpenAIServer(tokenizer, tokenizer_dir, spec_decode_per_request=(3, 12, 9)) as server:
        server.spec_decode_totals = [100, 400, 0]  # up a while with nothing accepted: totals would say 9n/(400+12n)
        result = await run_bench(_args(server, num_prompts=[4, 2], concurrency=[2, 1], warmup=1))
    assert [(s.spec_acceptance_rate, s.spec_acceptance_length) for s in result.summaries] == [(0.75, 4.0)] * 2
    assert capsys.readouterr().err.count(
        "speculative decoding: acceptance rate 75.0%, acceptance length 4.00 (the server's /metrics over this run)"
    ) == 2

    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:  # no /metrics
        result = await run_bench(_args(server, num_prompts=[2], concurrency=[1]))
    assert math.isnan(result.summaries[0].spec_acceptance_rate)
    assert "speculative" not in capsys.readouterr().err


# ---- runs against the fake server ------------------------------------------------------------------------


async def test_token_counts_are_exact_and_checked_through_usage(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        result = await run_bench(_args(server, num_prompts=[9], concurrency=[3]))
    (summary,), (records,) = result.summaries, result.records
    assert summary.model == "fake-model"  # from GET /v1/models; its `root` gave the tokenizer
    assert (summary.successes, summary.failures, summary.usage_mismatches) == (9, 0, 0)
    assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [(PROMPT_TOKENS, OUTPUT_TOKENS)] * 9
    assert summary.generated_tokens == 9 * OUTPUT_TOKENS
    assert summary.total_prompt_tokens == 9 * PROMPT_TOKENS
    assert len({b["prompt"] for b in server.bodies}) == 9
    assert all(b["ignore_eos"] and b["max_tokens"] == OUTPUT_TOKENS and b["stream"] for b in server.bodies)
    assert server.max_in_flight <= 3


async def test_temperature_is_left_to_the_server_unless_asked_for_as_vllms_client_does(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        await run_bench(_args(server, num_prompts=[2], concurrency=[1]))
        assert all("temperature" not in b for b in server.bodies)
        server.bodies.clear()
        await run_bench(_args(server, num_prompts=[2], concurrency=[1], temperature=0.0))
        assert [b["temperature"] for b in server.bodies] == [0.0, 0.0]


async def test_ttft_is_the_first_content_chunk_and_precedes_the_end_of_every_request(
    tokenizer, tokenizer_dir
):
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        result = await run_bench(_args(server, endpoint="chat"))  # chat opens with a role-only chunk
    records = result.records[0]
    assert all(r.ok for r in records)
    for r in records:
        assert 0 < r.ttft_s < r.latency_s
        assert r.ttft_s == r.chunk_times_s[0]
        assert r.text == "".join(f" t{i}" for i in range(OUTPUT_TOKENS))
        assert len(r.inter_token_latencies_s) == OUTPUT_TOKENS - 1
    assert result.summaries[0].usage_mismatches == 0


async def test_throughput_is_generated_tokens_over_the_runs_wall_time(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        result = await run_bench(_args(server, num_prompts=[4, 8], concurrency=[1, 4], warmup=2))
    assert len(server.bodies) == 2 + 4 + 8  # warm-up requests are sent but not measured
    for summary, records in zip(result.summaries, result.records, strict=True):
        assert summary.wall_s == pytest.approx(
            max(r.end_s for r in records) - min(r.start_s for r in records)
        )
        assert summary.output_throughput == pytest.approx(summary.generated_tokens / summary.wall_s)
        assert summary.total_throughput == pytest.approx(
            (summary.generated_tokens + summary.total_prompt_tokens) / summary.wall_s
        )
    assert [(s.concurrency, s.num_prompts, s.generated_tokens) for s in result.summaries] == [
        (1, 4, 4 * OUTPUT_TOKENS),
        (4, 8, 8 * OUTPUT_TOKENS),
    ]


async def test_half_the_requests_refused_are_counted_and_summarised(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir, refuse_every_other=True) as server:
        result = await run_bench(_args(server, num_prompts=[10], concurrency=[2]))
    summary = result.summaries[0]
    assert (summary.successes, summary.failures) == (5, 5)
    assert summary.generated_tokens == 5 * OUTPUT_TOKENS
    assert summary.errors == "5 x HTTP 503: The server is overloaded; retry later."


def test_an_api_key_mismatch_fails_every_request_and_lands_in_the_csv(
    tokenizer, tokenizer_dir, tmp_path, capsys
):
    out = tmp_path / "runs.csv"
    with FakeOpenAIServer(tokenizer, tokenizer_dir, api_key="right") as server:
        argv = [
            "--base-url",
            server.base_url,
            "--model",
            "fake-model",
            "--tokenizer",
            tokenizer_dir,
            "--api-key",
            "wrong",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "4",
            "--num-prompts",
            "5",
            "--concurrency",
            "5",
            "--no-progress",
            "--csv",
            str(out),
        ]
        assert main(argv) == 1
    with open(out, newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["successes"], row["failures"]) == ("0", "5")
    assert row["errors"] == "5 x HTTP 401: Incorrect API key provided."
    assert "0/5" in capsys.readouterr().out


async def test_a_server_that_stops_early_is_reported_as_a_usage_mismatch(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir, short_by=3) as server:
        result = await run_bench(_args(server))
    summary = result.summaries[0]
    assert summary.successes == 6 and summary.usage_mismatches == 6
    assert summary.errors == f"6 x usage: completion_tokens {OUTPUT_TOKENS - 3} != {OUTPUT_TOKENS}"


async def test_an_error_event_mid_stream_fails_the_request(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir, fail_after=2) as server:
        result = await run_bench(_args(server, num_prompts=[3]))
    summary = result.summaries[0]
    assert (summary.successes, summary.failures, summary.generated_tokens) == (0, 3, 0)
    assert summary.errors == "3 x error event: engine died"


async def test_a_model_with_no_local_tokenizer_asks_for_one():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        args = BenchArgs(
            base_url=f"http://127.0.0.1:{port}",
            model="m",
            prompt_tokens=8,
            output_tokens=2,
            num_prompts=[3],
            concurrency=[3],
            progress=False,
        )
        with pytest.raises(FileNotFoundError, match="--tokenizer"):
            await run_bench(args)  # no local tokenizer for model "m"


async def test_connection_errors_are_counted_as_failures(tokenizer_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        args = BenchArgs(
            base_url=f"http://127.0.0.1:{port}/v1/",
            model="m",
            tokenizer=tokenizer_dir,
            prompt_tokens=8,
            output_tokens=2,
            num_prompts=[3],
            concurrency=[3],
            progress=False,
        )
        result = await run_bench(args)
    assert (result.summaries[0].successes, result.summaries[0].failures) == (0, 3)
    assert result.summaries[0].errors.startswith("3 x ConnectError")


async def test_poisson_arrivals_follow_the_seeded_schedule_under_the_concurrency_cap(
    tokenizer, tokenizer_dir
):
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        result = await run_bench(_args(server, num_prompts=[12], concurrency=[2], request_rate=100.0, seed=5))
    records = result.records[0]
    assert all(r.ok for r in records)
    assert [r.scheduled_s for r in records] == pytest.approx(list(poisson_arrival_offsets(12, 100.0, 5)))
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in records)  # never released before its arrival
    assert server.max_in_flight <= 2
    assert result.summaries[0].request_rate == 100.0


def test_poisson_gaps_have_mean_one_over_the_rate():
    offsets = poisson_arrival_offsets(20000, 10.0, seed=1)
    assert offsets[0] == 0.0 and (offsets[1:] >= offsets[:-1]).all()
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(0.1, rel=0.03)
    assert (poisson_arrival_offsets(4, float("inf"), seed=1) == 0).all()


def test_cli_writes_csv_json_and_plot_and_report_merges_labels(tokenizer, tokenizer_dir, tmp_path, capsys):
    import matplotlib.image

    paths = {name: tmp_path / name for name in ("a.csv", "b.csv", "a.json", "a.png", "merged.png")}
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        common = [
            "--base-url",
            server.base_url,
            "--prompt-tokens",
            "24",
            "--output-tokens",
            "4",
            "--concurrency",
            "1,3",
            "--num-prompts",
            "2,6",
            "--no-progress",
        ]
        assert (
            main(
                [
                    *common,
                    "--label",
                    "alpha",
                    "--csv",
                    str(paths["a.csv"]),
                    "--json",
                    str(paths["a.json"]),
                    "--plot",
                    str(paths["a.png"]),
                ]
            )
            == 0
        )
        assert main([*common, "--label", "beta", "--csv", str(paths["b.csv"])]) == 0
        assert (
            main(
                [
                    *common,
                    "--label",
                    "beta",
                    "--csv",
                    str(paths["b.csv"]),
                    "--concurrency",
                    "3",
                    "--num-prompts",
                    "3",
                ]
            )
            == 0
        )  # appended
    with open(paths["b.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["concurrency"], r["num_prompts"]) for r in rows] == [
        ("beta", "1", "2"),
        ("beta", "3", "6"),
        ("beta", "3", "3"),
    ]
    assert all(r["prompt_tokens"] == "24" and r["output_tokens"] == "4" for r in rows)
    runs = json.loads(paths["a.json"].read_text())["runs"]
    assert [len(run["requests"]) for run in runs] == [2, 6]
    assert runs[1]["summary"]["successes"] == 6

    capsys.readouterr()
    assert (
        main(
            [
                "report",
                str(paths["a.csv"]),
                str(paths["b.csv"]),
                "--plot",
                str(paths["merged.png"]),
                "--baseline",
                "beta",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "Throughput (tok/s)" in printed and "alpha" in printed and "beta" in printed
    assert "alpha vs beta at 3: throughput x" in printed
    for png in (paths["a.png"], paths["merged.png"]):
        assert matplotlib.image.imread(png).shape[:2] == (420, 1100)


# ---- vLLM's flag names ----------------------------------------------------------------------------------


def bench_settings(*argv: str) -> BenchArgs:
    """The settings a `shardserve bench` command line parses to."""
    import argparse

    from bench.cli import add_parser, bench_args_from

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return bench_args_from(parser.parse_args(["bench", *argv]))


def test_vllm_bench_serve_flag_names_parse_to_the_same_settings_as_ours():
    ours = bench_settings(
        "--base-url", "http://127.0.0.1:8123", "--endpoint", "chat", "--model", "m", "--tokenizer", "/tok",
        "--prompt-tokens", "256", "--output-tokens", "32", "--shared-prefix-tokens", "64", "--num-prompts", "50",
        "--concurrency", "8", "--warmup", "3", "--seed", "7", "--no-progress",
    )
    vllms = bench_settings(
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--host", "127.0.0.1", "--port", "8123",
        "--dataset-name", "random", "--model", "m", "--tokenizer", "/tok", "--random-input-len", "256",
        "--random-output-len", "32", "--random-prefix-len", "64", "--num-prompts", "50", "--max-concurrency", "8",
        "--num-warmups", "3", "--seed", "7", "--disable-tqdm", "--ignore-eos",
    )
    assert vllms == ours
    assert (ours.endpoint, ours.concurrency, ours.warmup, ours.progress) == ("chat", [8], 3, False)
    assert bench_settings("--endpoint", "/v1/completions").endpoint == "completions"
    assert bench_settings().base_url == BenchArgs().base_url
    assert not bench_settings("--no-ignore-eos").ignore_eos
    with pytest.raises(SystemExit):  # the backend and the endpoint disagree
        bench_settings("--backend", "openai-chat", "--endpoint", "/v1/completions")
    with pytest.raises(SystemExit):  # only random prompts are built in
        bench_settings("--dataset-name", "sharegpt")


def test_a_vllm_bench_serve_command_line_runs_against_a_server(tokenizer, tokenizer_dir):
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        host, port = server.base_url.removeprefix("http://").split(":")
        argv = [
            "--backend", "openai-chat", "--host", host, "--port", port, "--endpoint", "/v1/chat/completions",
            "--dataset-name", "random", "--model", "fake-model", "--tokenizer", tokenizer_dir,
            "--random-input-len", "24", "--random-output-len", "4", "--num-prompts", "4", "--max-concurrency", "2",
            "--num-warmups", "1", "--seed", "3", "--ignore-eos", "--disable-tqdm",
        ]
        assert main(argv) == 0
    assert len(server.bodies) == 1 + 4  # the warm-up request, then the measured ones
    assert all("messages" in b and b["max_tokens"] == 4 and b["ignore_eos"] for b in server.bodies)
    assert server.max_in_flight <= 2


def test_extra_body_is_merged_into_every_request_as_vllm_bench_serve_does(tokenizer, tokenizer_dir):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
             "max_tokens": 3}
    with FakeOpenAIServer(tokenizer, tokenizer_dir) as server:
        host, port = server.base_url.removeprefix("http://").split(":")
        argv = ["--host", host, "--port", port, "--model", "fake-model", "--tokenizer", tokenizer_dir,
                "--random-input-len", "24", "--random-output-len", "4", "--num-prompts", "3", "--max-concurrency", "1",
                "--no-ignore-eos", "--disable-tqdm", "--extra-body", json.dumps(extra)]
        main(argv)
    assert len(server.bodies) == 3
    # its keys win over the bench's own, as in vllm bench serve (the payload is updated with it last)
    assert all(b["response_format"] == extra["response_format"] and b["max_tokens"] == 3 for b in server.bodies)
    with pytest.raises(SystemExit):  # a JSON array is not a body
        bench_settings("--extra-body", "[1]")
    with pytest.raises(SystemExit):
        bench_settings("--extra-body", "{not json")
