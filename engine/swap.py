"""Copies KV blocks between one rank's device cache and its host block pool, off the critical path.

Swap-outs run behind the forward passes: on CPU in one worker thread, on CUDA on a side stream
that first waits for the K/V the earlier steps wrote. A swap-in is needed by the very step that
schedules it, so it runs ahead of that step's forward pass (on CPU directly, on CUDA queued on
the compute stream) and waits for nothing else.

Each step a rank checks the blocks it is about to write (the step's slot mapping and swap-in
targets) and the host blocks it is about to read against the swap-outs still in flight, and
waits for those copies only. The block manager already keeps such blocks from being handed out
until rank 0 reports the copy done; the check keeps every rank safe when its own copy is slower.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cpu_binding import unbind_current_thread


@dataclass
class SwapOutJob:
    ticket: int
    device_blocks: set[int]
    host_blocks: set[int]
    future: Future | None = None  # CPU
    event: torch.cuda.Event | None = None  # CUDA
    buffers: list[torch.Tensor] = field(default_factory=list)  # CUDA: kept alive until the copy lands

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.event.query()

    def wait(self) -> None:
        """Block the host until the copy finished (re-raises a failed copy)."""
        if self.future is not None:
            self.future.result()
        else:
            self.event.synchronize()


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in the list, first id, length) of each run of consecutive ids."""
    runs, start = [], 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, block_ids[start], i - start))
            start = i
    return runs


class KVSwapper:
    """The host block pool of one rank and the copies in and out of it."""

    def __init__(self, kv_caches: list[torch.Tensor], num_host_blocks: int, device: torch.device):
        self.kv_caches = kv_caches  # per layer [2, kv_heads, num_blocks, block_size, head_dim]
        self.device = device
        two, kv_heads, _, block_size, head_dim = kv_caches[0].shape
        pin = device.type == "cuda"
        # per layer [num_host_blocks, 2, kv_heads, block_size, head_dim]: each block contiguous
        self.host_caches = [
            torch.empty((num_host_blocks, two, kv_heads, block_size, head_dim), dtype=cache.dtype, pin_memory=pin)
            for cache in kv_caches
        ]
        self.in_flight: dict[int, SwapOutJob] = {}
        self.copy_thread = ThreadPoolExecutor(
            1, thread_name_prefix="kv-swap-out", initializer=unbind_current_thread) if device.type != "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # tests: runs on the copy thread before each CPU swap-out, e.g. to hold it until released
        self.swap_out_hook: Callable[[], None] | None = None
        self.num_swap_out_waits = 0  # times a step had to wait for a swap-out it needed

    @property
    def num_host_blocks(self) -> int:
        return self.host_caches[0].shape[0]

    def before_step(
        self,
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        ticket: int | None,
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> None:
        """Start this step's swap-outs, make its swap-ins, and wait for the copies it conflicts with."""
        earlier = [job for job in self.in_flight.values() if not job.done()]
        if swap_out:  # this step's own copies read blocks no step may write before they are reported
            self._start_swap_out(ticket, swap_out)
        if earlier:
            written = {device for _, device in swap_in}
            if slot_mapping.numel():
                written.update(np.unique(slot_mapping.numpy() // block_size).tolist())
            read_host = {host for host, _ in swap_in}
            for job in earlier:
                if job.device_blocks & written or job.host_blocks & read_host:
                    self.num_swap_out_waits += 1
                    self._wait_on(job)
        if swap_in:
            self._swap_in(swap_in)

    def poll(self) -> list[int]:
        """Tickets of swap-outs that finished since the last poll (never blocks)."""
        done = [ticket for ticket, job in self.in_flight.items() if job.done()]
        for ticket in done:
            self.in_flight.pop(ticket).wait()  # surfaces a failed copy
        return done

    def wait_all(self) -> list[int]:
        """Block until every swap-out in flight finished; their tickets."""
        for job in self.in_flight.values():
            job.wait()
        return self.poll()

    def shutdown(self) -> None:
        if self.copy_thread is not None:
            self.copy_thread.shutdown(wait=True)

    # ---- copies -----------------------------------------------------------------------------

    def _start_swap_out(self, ticket: int, pairs: list[tuple[int, int]]) -> None:
        device_ids = [device for device, _ in pairs]
        host_ids = [host for _, host in pairs]
        job = SwapOutJob(ticket, set(device_ids), set(host_ids))
        if self.stream is None:
            job.future = self.copy_thread.submit(self._copy_out_cpu, device_ids, host_ids)
        else:
            self._copy_out_cuda(job, device_ids, host_ids)
        self.in_flight[ticket] = job

    @torch.inference_mode()
    def _copy_out_cpu(self, device_ids: list[int], host_ids: list[int]) -> None:
        if self.swap_out_hook is not None:
            self.swap_out_hook()
        device_index = torch.tensor(device_ids, dtype=torch.int64)
        host_index = torch.tensor(host_ids, dtype=torch.int64)
        for cache, host in zip(self.kv_caches, self.host_caches):
            # [n, 2, kv_heads, block_size, head_dim]
            host.index_copy_(0, host_index, cache.index_select(2, device_index).permute(2, 0, 1, 3, 4))

    def _copy_out_cuda(self, job: SwapOutJob, device_ids: list[int], host_ids: list[int]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # K/V of earlier steps are written
        with torch.cuda.stream(self.stream):
            device_index = torch.tensor(device_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            for cache, host in zip(self.kv_caches, self.host_caches):
                # [n, 2, kv_heads, block_size, head_dim] on the device, then into the pinned host rows
                gathered = cache.index_select(2, device_index).permute(2, 0, 1, 3, 4).contiguous()
                for position, first, length in _runs(host_ids):
                    host[first : first + length].copy_(gathered[position : position + length], non_blocking=True)
                job.buffers.append(gathered)
            job.buffers.append(device_index)
            job.event = torch.cuda.Event()
            job.event.record(self.stream)

    def _wait_on(self, job: SwapOutJob) -> None:
        if job.event is not None:
            torch.cuda.current_stream(self.device).wait_event(job.event)  # the compute stream, not the host
        else:
            job.wait()

    @torch.inference_mode()
    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        host_ids = [host for host, _ in pairs]
        device_index = torch.tensor([device for _, device in pairs], dtype=torch.int64)
        if self.stream is None:
            host_index = torch.tensor(host_ids, dtype=torch.int64)
            for cache, host in zip(self.kv_caches, self.host_caches):
                # [2, kv_heads, n, block_size, head_dim]
                cache.index_copy_(2, device_index, host.index_select(0, host_index).permute(1, 2, 0, 3, 4))
            return
        device_index = device_index.to(self.device, non_blocking=True)
        for cache, host in zip(self.kv_caches, self.host_caches):
            staged = torch.empty((len(pairs), *host.shape[1:]), dtype=host.dtype, device=self.device)
            for position, first, length in _runs(host_ids):
                staged[position : position + length].copy_(host[first : first + length], non_blocking=True)
            cache.index_copy_(2, device_index, staged.permute(1, 2, 0, 3, 4))
