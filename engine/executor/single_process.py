"""The executor of a one-rank engine: the model runner, in the engine's own thread."""

from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineDeadError
from engine.executor.base import RankMemory, measure_memory
from engine.executor.gpu_devices import this_process, use_reserved_gpu
from engine.model_runner import ModelRunner, StepInput
from engine.sampler import SampledToken, SamplingBatch


class SingleProcessExecutor:
    """Rank 0 alone: a failed step raises out of `execute_model`, so there is no worker to watch."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        if config.resolved_device().type == "cuda":
            use_reserved_gpu(this_process(0))  # a Serve replica's GPU, which Ray reserved; else the current one
        self.runner: ModelRunner | None = ModelRunner(config, model_config, max_model_len=max_model_len)
        self.num_blocks = self.runner.num_blocks
        self.num_host_blocks = self.runner.num_host_blocks

    def execute_model(self, step: StepInput, sampling: SamplingBatch | None) -> list[SampledToken] | None:
        return self._live_runner().execute_model(step, sampling)

    def poll_swap_outs(self) -> list[int]:
        return self._live_runner().poll_swap_outs()

    def wait_swap_outs(self) -> list[int]:
        return self._live_runner().wait_swap_outs()

    def check_health(self) -> None:
        self._live_runner()

    def lost_rank(self) -> str | None:
        return None  # the one rank is this process

    def warm_up_idle(self) -> bool:
        """One unit of the runner's idle warm-up; whether any is left."""
        return self.runner is not None and self.runner.warm_up_idle()

    def memory(self) -> list[RankMemory]:
        return [measure_memory(self._live_runner())]

    def shutdown(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.shutdown()

    def _live_runner(self) -> ModelRunner:
        if self.runner is None:
            raise EngineDeadError("the engine was shut down")
        return self.runner
