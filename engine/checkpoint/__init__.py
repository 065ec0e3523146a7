"""Checkpoints on disk: reading Hugging Face safetensors directories and GGUF files into a ModelConfig, a
tokenizer and this rank's weights (loader, gguf, gguf_cache, model_config), the cache folder they share
(cache_dir), the demo model fetched from the package registry (demo) and the random-weight models that
tests, benchmarks and `shardserve make-model` write (random_model).

Import the module you need: this file imports nothing, so importing one module loads none of the others.
"""
