"""Random-weight Llama / Qwen2 / Qwen3 model directories with a trained byte-level BPE tokenizer.

The models of the tests (tiny preset), the benchmarks (bench preset) and `shardserve make-model`; the
served default is the demo model (engine/checkpoint/demo.py), not one of these. Nothing downloads, and
transformers loads the same directory, so it is also the correctness oracle's input. Weights come from a
fixed seed; the tokenizer is trained on a fixed, sorted list of this Python's standard-library sources
(deterministic on a machine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Literal

import torch

from engine.checkpoint.cache_dir import cache_root

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2

# ChatML-like, with <s> / </s> standing for <|im_start|> / <|im_end|>: an assistant turn ends
# with </s>, the model's EOS, so generation stops where a turn would.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

# Qwen2Tokenizer's pre-tokenizer split (transformers/models/qwen2/tokenization_qwen2.py).
# transformers loads qwen2 and qwen3 directories' tokenizers with that class.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

PRESETS: dict[str, dict] = {
    # Small enough for exactness tests on CPU; GQA (4 query heads, 2 KV heads) so TP=4
    # exercises KV-head replication. At hidden 64 / vocab 512 greedy outputs fall into short
    # loops even at initializer_range 0.1; hidden 256 / vocab 1024 keeps them diverse.
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
    # The shape the benchmarks use (about 56M parameters).
    "bench": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
}
# At transformers' default 0.02 a random model repeats one token forever, hiding most bugs;
# at 0.1 greedy outputs are diverse.
DEFAULT_INITIALIZER_RANGE = 0.1
# Weights on disk: float32 for tiny (exactness tests), bfloat16 for bench (the serving dtype).
PRESET_DTYPES = {"tiny": torch.float32, "bench": torch.bfloat16}
# Corpus size for tokenizer training: enough text for the vocabulary's merges (~1 s for 32k).
_CORPUS_CHARS = {"tiny": 300_000, "bench": 4_000_000}
# Qwen3's head_dim is explicit: 128 as in the real checkpoints, not hidden_size / num_attention_heads
# (64 in both presets), so the query width differs from the hidden size.
QWEN3_HEAD_DIM = 128
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def make_model(
    arch: Literal["llama", "qwen2", "qwen3"],
    preset: Literal["tiny", "bench"],
    out_dir: str | Path,
    seed: int = 0,
    initializer_range: float | None = None,
    rope_scaling: dict | None = None,
) -> Path:
    """Write a Hugging Face model directory (config, safetensors, tokenizer, chat template)."""
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    init_range = DEFAULT_INITIALIZER_RANGE if initializer_range is None else initializer_range
    common = dict(
        **PRESETS[preset],
        initializer_range=init_range,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        rope_scaling=rope_scaling,
    )
    if arch == "llama":
        config, model_class = LlamaConfig(**common, tie_word_embeddings=False), LlamaForCausalLM
    elif arch == "qwen2":
        # Qwen2 always has q/k/v bias; tied embeddings as in the small Qwen2 checkpoints.
        config, model_class = Qwen2Config(**common, tie_word_embeddings=True), Qwen2ForCausalLM
    elif arch == "qwen3":
        # q/k norms, no bias, explicit head_dim; tied embeddings as in the small Qwen3 checkpoints.
        config = Qwen3Config(**common, head_dim=QWEN3_HEAD_DIM, tie_word_embeddings=True)
        model_class = Qwen3ForCausalLM
    else:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")

    torch.manual_seed(seed)
    model = model_class(config)
    _randomize_biases_and_norms(model, init_range, seed)
    model = model.to(PRESET_DTYPES[preset])
    model.config.dtype = PRESET_DTYPES[preset]
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(str(out))

    tokenizer = train_tokenizer(
        config.vocab_size, _CORPUS_CHARS[preset], config.max_position_embeddings, arch
    )
    tokenizer.save_pretrained(str(out))
    return out


def _randomize_biases_and_norms(model: torch.nn.Module, init_range: float, seed: int) -> None:
    """transformers initialises biases to 0 and norm weights to 1: a wrong mapping of either
    would go unnoticed by the oracle tests, so give them random values too."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * init_range)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * init_range)


def train_tokenizer(vocab_size: int, corpus_chars: int, model_max_length: int, arch: str = "llama"):
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (specials at ids 0, 1, 2).

    transformers loads a qwen2 or qwen3 directory's tokenizer as Qwen2Tokenizer whatever
    tokenizer_config.json says, and that class rebuilds the pipeline with its own normalizer
    and pre-tokenizer: for those we train with that same pipeline, so what loads is what trained.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    if arch in ("qwen2", "qwen3"):
        bpe.normalizer = normalizers.NFC()
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_corpus(corpus_chars), trainer)
    if bpe.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer training produced {bpe.get_vocab_size()} tokens, wanted {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",  # set, or Qwen2Tokenizer adds its own <|endoftext|> past the vocabulary
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _training_corpus(max_chars: int) -> list[str]:
    """The first `max_chars` characters of the standard library's top-level modules, by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def default_bench_model_dir() -> Path:
    """The random-weight, bench-shaped Llama the benchmarks use."""
    return cache_root() / "bench-llama"


def ensure_bench_model(out_dir: str | Path | None = None, arch: str = "llama", preset: str = "bench") -> Path:
    """The bench model directory (random weights, bench preset), created on first use (built aside, then renamed into place)."""
    out = Path(out_dir) if out_dir is not None else default_bench_model_dir()
    if _is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        make_model(arch, preset, staging)
        if out.exists() and not _is_complete(out):
            shutil.rmtree(out)  # a half-written directory from an interrupted run
        try:
            os.replace(staging, out)
        except OSError:
            if not _is_complete(out):  # lost a race to another process: theirs is as good
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _is_complete(model_dir: Path) -> bool:
    return all(
        (model_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")
    )


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="shardserve make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the cache folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initializer-range", type=float, default=None)
    args = parser.parse_args(argv)
    out = args.out or cache_root() / f"demo-{args.arch}-{args.preset}"
    path = make_model(args.arch, args.preset, out, seed=args.seed, initializer_range=args.initializer_range)
    print(path)
    return path


if __name__ == "__main__":
    main()
