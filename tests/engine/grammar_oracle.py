"""The structured-output oracle: transformers' greedy generate under xgrammar's own logits processor."""

import json

import torch
import xgrammar as xgr

from engine.structured_output.compiler import json_schema_grammar


def hf_constrained_greedy(hf_greedy, model_dir, tokenizer, prompts, schema, max_new_tokens):
    """transformers' greedy generate under xgrammar's own logits processor, over the same JSON grammar."""
    model = hf_greedy.model(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size,
                                              stop_token_ids=[model.generation_config.eos_token_id])
    # the engine's grammar for the schema (xgrammar's, its bounded strings kept to JSON's characters)
    compiled = xgr.GrammarCompiler(info).compile_grammar(json_schema_grammar(json.dumps(schema), compact=False))
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
                                 eos_token_id=model.generation_config.eos_token_id,
                                 pad_token_id=model.generation_config.eos_token_id)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs
