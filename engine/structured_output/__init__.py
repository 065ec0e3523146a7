"""Structured outputs: a request's constraint (JSON schema, regex, choice, EBNF grammar, structural tag)
compiled with xgrammar (compiler.py) and enforced token by token (grammar.py): each step the scheduled
constrained sequences get a bitmask of their allowed next tokens, which the sampler applies to the logits
before anything draws from them (kernels/bitmask.py)."""
