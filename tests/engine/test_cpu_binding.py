"""cpu_threads_bind: the lists of cores each rank's threads are bound to, what "auto" resolves to, and a bound
engine's threads on their cores (greedy tokens still equal transformers': tests/engine/test_hf_equivalence.py)."""

from __future__ import annotations

import os
import threading

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.cpu_binding import (
    allowed_cores,
    check_setting,
    format_core_list,
    left_out_cores,
    parse_core_list,
    resolve_auto,
    unbind_current_thread,
)
from kernels.cpu_threads import bind_threads


@pytest.mark.parametrize("text, cores", [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0,2,4-5", [0, 2, 4, 5]),
                                         ("7,3-4", [7, 3, 4])])
def test_a_list_of_cores_reads_as_vllm_writes_it(text, cores):
    assert parse_core_list(text) == cores
    assert parse_core_list(format_core_list(cores)) == cores


@pytest.mark.parametrize("text, message", [("", "not a list"), ("0-", "not a list"), ("a", "not a list"),
                                           ("3-1", "backwards"), ("0-2,1", "twice")])
def test_a_malformed_list_is_refused_with_its_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_core_list(text)


def test_a_setting_has_one_list_per_rank_and_no_shared_core():
    check_setting("0-1|2-3", 2)
    check_setting("auto", 4)
    with pytest.raises(ValueError, match="1 list\\(s\\) of cores for 2 tensor-parallel rank"):
        check_setting("0-3", 2)
    with pytest.raises(ValueError, match="one core to two ranks"):
        check_setting("0-2|2-3", 2)


def test_engine_config_refuses_a_bad_setting_and_a_thread_count_that_disagrees():
    with pytest.raises(ValidationError, match="backwards"):
        EngineConfig(model="m", cpu_threads_bind="3-1")
    with pytest.raises(ValidationError, match="disagree"):
        EngineConfig(model="m", cpu_threads_bind="0-1", cpu_threads=3)
    assert EngineConfig(model="m", cpu_threads_bind="0-1", cpu_threads=2).resolved_cpu_threads() == 2


def test_a_bound_rank_runs_one_thread_per_core_of_its_list():
    config = EngineConfig(model="m", device="cpu", tensor_parallel_size=2, cpu_threads_bind="0-2|3")
    assert (config.rank_cpu_cores(0), config.rank_cpu_cores(1)) == ([0, 1, 2], [3])
    assert (config.resolved_cpu_threads(0), config.resolved_cpu_threads(1)) == (3, 1)


@pytest.mark.parametrize("setting", ["auto", "none"])
def test_auto_and_none_leave_an_engine_unbound(setting):
    config = EngineConfig(model="m", device="cpu", cpu_threads_bind=setting)
    assert config.rank_cpu_cores(0) is None
    assert config.resolved_cpu_threads() == len(allowed_cores())


@pytest.mark.parametrize("cores, tp, resolved", [
    (range(2), 1, "none"),  # a 2-core node: binding measured no faster (docs/OPERATIONS.md "CPU threads")
    (range(2), 2, "none"),
    (range(8), 1, "0-6"),  # one core for the control plane
    (range(8), 2, "0-2|3-5"),
    (range(16), 4, "0-2|3-5|6-8|9-11"),
    ({0, 1, 2, 3}, 4, "none"),  # fewer compute cores than ranks
    ({4, 5, 6, 9}, 1, "4-6"),  # a cpuset's own cores
])
def test_auto_binds_all_but_one_core_of_a_larger_node_split_between_the_ranks(cores, tp, resolved):
    assert resolve_auto(tp, set(cores)) == resolved


def test_the_cores_no_rank_has_are_left_to_the_control_plane():
    assert left_out_cores("0-6", set(range(8))) == [7]
    assert left_out_cores("1", {0, 1}) == [0]
    assert left_out_cores("0|1", {0, 1}) == []
    assert left_out_cores("auto", {0, 1}) == [] and left_out_cores("none", {0, 1}) == []


def on_a_thread_of_its_own(fn):
    """Run fn on a new thread and return what it returned: binding must not touch the test process's main thread,
    whose affinity every process it starts later would inherit."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_binding_puts_each_thread_of_the_callers_team_on_its_core_and_helpers_get_every_core_back():
    cores = sorted(allowed_cores())

    def bind_and_look():
        running_on = bind_threads(list(reversed(cores)))
        own = os.sched_getaffinity(0)
        helper: dict = {}
        thread = threading.Thread(target=lambda: (helper.update(before=os.sched_getaffinity(0)),
                                                  unbind_current_thread(),
                                                  helper.update(after=os.sched_getaffinity(0))))
        thread.start()
        thread.join()
        return running_on, own, helper

    running_on, own, helper = on_a_thread_of_its_own(bind_and_look)
    assert running_on == list(reversed(cores))  # thread i runs on core i of the list, the caller on the first
    assert own == {cores[-1]}
    assert helper["before"] == {cores[-1]}  # a thread inherits its starter's one core...
    assert helper["after"] == set(cores)  # ...until it takes the process's cores back
    assert os.sched_getaffinity(0) == set(cores)  # the test's own thread is untouched


def test_binding_to_a_core_outside_the_cpuset_is_refused_by_name():
    with pytest.raises(RuntimeError, match="core 1000 refused"):
        on_a_thread_of_its_own(lambda: bind_threads([1000]))
    with pytest.raises(RuntimeError, match="core 4096 is not a core number"):
        on_a_thread_of_its_own(lambda: bind_threads([4096]))


def test_without_the_native_kernels_the_calling_thread_is_kept_to_the_cores(monkeypatch):
    from kernels import cpu_native

    monkeypatch.setattr(cpu_native, "load", lambda target=None: None)
    last = max(allowed_cores())

    def bind_and_look():
        return bind_threads([last]), os.sched_getaffinity(0)

    assert on_a_thread_of_its_own(bind_and_look) == (None, {last})
