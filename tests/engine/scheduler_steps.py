"""Scheduler tests' stand-in for a forward pass (shared by the scheduler, prefix-cache and swap tests)."""


def run_step(sched_out, new_token=7):
    """What the engine does after a forward pass: advance computed tokens, append sampled tokens."""
    for chunk in sched_out.chunks:
        completes = chunk.completes_sequence
        chunk.seq.num_computed_tokens += chunk.num_tokens
        if completes:
            chunk.seq.append_token(new_token, None)
