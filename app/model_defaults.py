"""What the served model gives the requests that leave things out, with vLLM's flags to change it.

- Sampling defaults (`--generation-config`): `auto` takes the sampling fields of the model directory's
  generation_config.json (vLLM's list: temperature, top_p, top_k, min_p, repetition_penalty, and
  max_new_tokens as the default max_tokens); `vllm` takes none; a folder takes that folder's file.
  `--override-generation-config` goes on top. The demo model is a GGUF file with no generation_config.json:
  under `auto` it gets its model card's recommendation instead (engine/checkpoint/demo.py).
- The chat template (`--chat-template`): a Jinja file, or the template text itself, in place of the
  tokenizer's own. ServeArgs reads a file once (`load_chat_template`), so the text travels to every replica;
  `use_chat_template` puts it on a tokenizer where the tokenizer is loaded for serving (the replica's engine,
  the ingress), and app/prompts.py renders with it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERATION_CONFIG_FILE = "generation_config.json"
# the generation_config.json fields that vLLM takes as request defaults, and their request names
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
JINJA_CHARS = "{}\n"  # vLLM's test: a value with any of these is a template, not a path


def generation_config_defaults(folder: str | Path) -> dict[str, float]:
    """The request defaults that `folder`'s generation_config.json sets; none if it has no such file."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    fields = json.loads(path.read_text())
    return {name: fields[key] for key, name in GENERATION_CONFIG_FIELDS.items() if fields.get(key) is not None}


def default_sampling(model: str | None, generation_config: str,
                     override: dict[str, float] | None = None) -> dict[str, float]:
    """What a request that leaves a sampling field (or max_tokens) out gets, before the engine's neutral
    defaults: the model's generation config as --generation-config says (`model` None: the demo model), with
    --override-generation-config on top (both merged, as in vLLM)."""
    if generation_config == "vllm":
        from_model: dict[str, float] = {}
    elif generation_config != "auto":
        from_model = generation_config_defaults(generation_config)
    elif model is None:
        from engine.checkpoint.demo import DEMO_GENERATION_CONFIG

        from_model = dict(DEMO_GENERATION_CONFIG)
    else:
        from_model = generation_config_defaults(model)  # a GGUF file has none beside it
    return {**from_model, **(override or {})}


def load_chat_template(value: str) -> str:
    """--chat-template's template: the file `value` names, else `value` itself when it reads as a template."""
    try:
        path = Path(value)
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError):  # a template's text can be too long, or odd, for a file name
        pass
    if not any(c in value for c in JINJA_CHARS):
        raise ValueError(f"chat_template {value!r} looks like a file path, but there is no such file")
    return value


def use_chat_template(tokenizer, chat_template: str | None) -> None:
    """Render chats with `chat_template` instead of the tokenizer's own (None: keep its own)."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
