"""Speculative decoding: a proposer guesses a decoding sequence's next tokens, and the target model checks
them all in one forward pass, scheduled like a prefill chunk of k+1 tokens (engine/scheduler.py).

The n-gram proposer (ngram.py) looks the sequence's last tokens up in its own prompt and output; the
draft-model proposer (draft.py) runs a smaller model of the same vocabulary greedily on its own KV cache. Every
position of a speculating chunk is sampled as if the proposals before it were accepted (verify.py builds
those rows), and the scheduler keeps the run of proposals that equal what was sampled, plus the sampled
token after it. The emitted tokens are the target's own samples, so greedy output is token for token what
it is without speculation, and a sampled one has exactly the target's distribution. Under a structured-output
grammar the proposals are cut to what the grammar accepts, and each verified row is masked as its position
would be (engine/structured_output/grammar.py).
"""
