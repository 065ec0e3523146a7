"""How `shardserve serve` resolves --cpu-threads-bind auto (app/cpu_placement.py); the served placement itself is
checked end to end in tests/app/test_cli_serve.py."""

from __future__ import annotations

import pytest

import app.cpu_placement as cpu_placement
from app.config import ServeArgs
from app.cpu_placement import plan_cpu_threads_bind


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(cpu_placement, "allowed_cores", lambda: frozenset(range(8)))


def plan(own_cluster=True, **settings) -> str:
    return plan_cpu_threads_bind(ServeArgs(device="cpu", **settings), own_cluster=own_cluster).cpu_threads_bind


def test_auto_on_our_own_ray_binds_all_but_one_core_of_a_larger_node(eight_cores):
    assert plan() == "0-6"
    assert plan(tensor_parallel_size=2) == "0-2|3-5"


def test_auto_on_a_two_core_machine_binds_nothing(monkeypatch):
    monkeypatch.setattr(cpu_placement, "allowed_cores", lambda: frozenset({0, 1}))
    assert plan() == "none"


@pytest.mark.parametrize("settings", [dict(num_replicas=2), dict(max_replicas=3), dict(cpu_threads=4)])
def test_auto_binds_nothing_where_replicas_may_share_a_node_or_the_thread_count_is_set(eight_cores, settings):
    assert plan(**settings) == "none"


def test_auto_on_a_joined_cluster_is_left_to_the_replica_which_binds_nothing(eight_cores):
    assert plan(own_cluster=False) == "auto"


def test_auto_binds_nothing_for_gpu_replicas(eight_cores):
    args = ServeArgs(device="cuda")
    assert plan_cpu_threads_bind(args, own_cluster=True).cpu_threads_bind == "none"


def test_a_list_given_is_kept_as_it_is(eight_cores):
    assert plan(cpu_threads_bind="2-5", max_replicas=2) == "2-5"
