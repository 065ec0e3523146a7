"""The scheduler tests' forward pass: the real Scheduler, with every sampled token fixed (no model)."""

from engine.config import EngineConfig
from engine.sampler import SampledToken
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stopping import StopChecker


def scheduler_with_fixed_tokens(
    config: EngineConfig, num_blocks: int, num_host_blocks: int = 0, max_model_len: int = 1 << 20
) -> Scheduler:
    """A scheduler (its block manager built from `config`) whose sequences stop on max_tokens or the context
    length only (no EOS, no text)."""
    stop_checker = StopChecker(eos_token_ids=(), max_model_len=max_model_len, detokenizer=None)
    return Scheduler(config, num_blocks, num_host_blocks, stop_checker)


def run_step(scheduler: Scheduler, out: SchedulerOutput, new_token: int = 7) -> None:
    """What the engine does after a forward pass: every sampled sequence gets `new_token`."""
    scheduler.update_from_output(out, [SampledToken(new_token, None) for _ in out.sampled_seqs])
