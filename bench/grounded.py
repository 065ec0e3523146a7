"""The input-grounded dataset: chat prompts asking the model to repeat, or lightly edit, a passage of code, so
that most of the answer copies the prompt (the load that n-gram speculative decoding is for).

Passages are Python source from the installed standard library (`sysconfig`'s stdlib folder): local, nothing
downloaded, and for one Python installation and seed always the same prompts. Each prompt is one user message,
a task and a passage from a random line of a random file, sized so that the server counts `prompt_tokens`
tokens (exactly where the tokenizer allows, else within a few): on /v1/chat/completions the message goes as
it is, on /v1/completions with the chat template applied by the client, as `vllm bench serve` sends its
custom dataset with `--backend vllm`. `write_custom_dataset` writes the messages for that client.
"""

from __future__ import annotations

import json
import keyword
import re
import sysconfig
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.prompts import Endpoint, PromptLengthError

# what the model is asked to do with the passage; {old}/{new}: an identifier of the passage and its new name
TASKS = (
    "Repeat the following Python code exactly, with no comment before or after it:\n\n{passage}",
    "Rewrite the following Python code with the name `{old}` renamed to `{new}` everywhere. Change nothing "
    "else and answer with the code only:\n\n{passage}",
    "Copy the following Python code with its `#` comments removed; keep every other line exactly as it "
    "is:\n\n{passage}",
)
RENAME_TASK = 1
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
_CHARS_PER_TOKEN = 8  # source text read per passage token wanted (code runs 2-4 characters a token)
_ADJUST_ROUNDS = 8
_FRESH_DRAWS = 8
_TOLERANCE = 4  # tokens off the target a prompt may be when trimming cannot land exactly


def stdlib_source_files() -> list[Path]:
    """The standard library's top-level Python files, in name order (the passages' source)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python source files in {sysconfig.get_paths()['stdlib']}")
    return files


class GroundedPromptBuilder:
    """Builds the grounded dataset's prompts for one endpoint, seeded: the same seed gives the same prompts.

    `build` gives user messages (what vLLM's custom dataset holds), `render` the text sent for one, and
    `count_tokens` counts a rendered prompt as the server will (usage.prompt_tokens).
    """

    def __init__(self, tokenizer, prompt_tokens: int, endpoint: Endpoint = "completions", seed: int = 0):
        if not getattr(tokenizer, "chat_template", None):
            raise PromptLengthError(
                "the grounded dataset asks through the chat template, and this tokenizer has none: "
                "use a tokenizer directory with a chat template"
            )
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.endpoint = endpoint
        self.rng = np.random.default_rng(seed)
        self.files = stdlib_source_files()
        self._lines: dict[int, list[str]] = {}
        self._used: set[tuple[int, int]] = set()  # (file, first line) of every passage drawn: no two alike
        room = prompt_tokens - max(self._count_message(task.format(passage="", old="x", new="x")) for task in TASKS)
        if room < 1:
            raise PromptLengthError(
                f"the grounded task and the chat template take {prompt_tokens - room} tokens; "
                f"--prompt-tokens {prompt_tokens} leaves no room for a passage"
            )

    def build(self, num_prompts: int) -> list[str]:
        """`num_prompts` new user messages, each a task and a passage of its own."""
        return [self._one_message() for _ in range(num_prompts)]

    def render(self, message: str) -> str:
        """The text sent for a user message: itself to chat, the chat template's rendering to completions."""
        if self.endpoint == "chat":
            return message
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )

    def token_ids(self, prompt: str) -> list[int]:
        """The token ids the server computes for a rendered prompt."""
        if self.endpoint == "chat":
            encoded = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        return self.tokenizer(prompt)["input_ids"]

    def count_tokens(self, prompt: str) -> int:
        return len(self.token_ids(prompt))

    def _count_message(self, message: str) -> int:
        return self.count_tokens(self.render(message))

    def _one_message(self) -> str:
        for _ in range(_FRESH_DRAWS):
            task = int(self.rng.integers(len(TASKS)))
            source_ids = self._source_ids(self.prompt_tokens)
            names = {"old": "x", "new": "x"}
            length = self.prompt_tokens - self._count_message(TASKS[task].format(passage="", **names))
            if task == RENAME_TASK:  # a name of the passage's first half, which trimming leaves in place
                names = self._rename(self.tokenizer.decode(source_ids[: max(length, 0) // 2]))
                if names is None:  # no name repeats there: repeat the passage instead
                    task, names = 0, {"old": "", "new": ""}
                length = self.prompt_tokens - self._count_message(TASKS[task].format(passage="", **names))
            best, best_excess = None, None
            for _ in range(_ADJUST_ROUNDS):
                message = TASKS[task].format(passage=self.tokenizer.decode(source_ids[:length]), **names)
                excess = self._count_message(message) - self.prompt_tokens
                if best_excess is None or abs(excess) < abs(best_excess):
                    best, best_excess = message, excess
                if excess == 0:
                    break
                length -= excess
            if best_excess is not None and abs(best_excess) <= _TOLERANCE:
                return best
        raise PromptLengthError(f"could not build a grounded prompt of {self.prompt_tokens} tokens")

    def _source_ids(self, num_tokens: int) -> list[int]:
        """Token ids of source text from a line not drawn before, continuing into the next files as needed."""
        for _ in range(64):
            file = int(self.rng.integers(len(self.files)))
            lines = self._file_lines(file)
            start = int(self.rng.integers(len(lines))) if lines else 0
            while start < len(lines) and not lines[start].strip():
                start += 1  # passages start on a line with code
            if (file, start) not in self._used:
                break
        self._used.add((file, start))
        text, chars = "".join(self._file_lines(file)[start:]), _CHARS_PER_TOKEN * num_tokens
        while True:
            while len(text) < chars:
                file = (file + 1) % len(self.files)
                text += "\n" + "".join(self._file_lines(file))
            ids = self.tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
            if len(ids) >= num_tokens:
                return ids
            chars *= 2

    def _file_lines(self, index: int) -> list[str]:
        if index not in self._lines:
            self._lines[index] = self.files[index].read_text(errors="replace").splitlines(keepends=True)
        return self._lines[index]

    def _rename(self, passage: str) -> dict[str, str] | None:
        """A name that occurs at least twice in the passage, drawn at random, and what to rename it to."""
        counts = Counter(m for m in _IDENTIFIER.findall(passage) if not keyword.iskeyword(m))
        names = sorted(name for name, n in counts.items() if n >= 2)
        if not names:
            return None
        old = names[int(self.rng.integers(len(names)))]
        return {"old": old, "new": f"renamed_{old}"}


def write_custom_dataset(path: str, messages: Sequence[str], output_tokens: int) -> None:
    """JSONL that `vllm bench serve --dataset-name custom --dataset-path PATH` reads: one {"prompt": message,
    "output_tokens": N} a line; vLLM applies the chat template to each prompt itself."""
    with open(path, "w") as f:
        for message in messages:
            f.write(json.dumps({"prompt": message, "output_tokens": output_tokens}) + "\n")
