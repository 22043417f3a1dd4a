"""The future-running rules of :mod:`cachescore._futures` on a real (in-process) LocalCluster."""

from __future__ import annotations

import threading
import time

import pytest

from cachescore._futures import paced, worker_threads


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


_running = {"now": 0, "most": 0}
_guard = threading.Lock()


def _tracked(x, seconds=0.05):
    with _guard:
        _running["now"] += 1
        _running["most"] = max(_running["most"], _running["now"])
    time.sleep(seconds)
    with _guard:
        _running["now"] -= 1
    if x < 0:
        raise ValueError(f"bad input {x}")
    return x * x


@pytest.mark.parametrize("slots", [None, 1])
def test_paced_keeps_at_most_slots_tasks_unfinished_and_returns_every_result(client, slots):
    """Twelve tasks on two single-threaded workers: with one slot they run one at a time (all
    submitted at once, two would run together); by default one per worker thread, so both
    workers compute. Every result comes back once, tagged; submitted in the order given."""
    assert worker_threads(client) == 2
    _running["most"] = 0
    submitted = []

    def submit(i):
        def go():
            submitted.append(i)
            return client.submit(_tracked, i, pure=False)
        return go

    got = list(paced(client, ((i, submit(i)) for i in range(12)), slots=slots))
    assert sorted(got) == [(i, i * i) for i in range(12)]
    assert submitted == list(range(12))
    assert _running["most"] == (2 if slots is None else 1)


def test_paced_cancels_what_is_in_flight_when_one_task_fails(client):
    """The first failure is raised (its message intact) and the tasks still in flight are
    cancelled; nothing after them is submitted."""
    submitted = []

    def submit(i):
        def go():
            submitted.append(i)
            return client.submit(_tracked, -1 if i == 1 else i, 0.01 if i == 1 else 2.0, pure=False)
        return go

    with pytest.raises(ValueError, match="bad input -1"):
        for _ in paced(client, ((i, submit(i)) for i in range(10)), slots=3):
            pass
    assert submitted == [0, 1, 2]
    deadline = time.time() + 5
    while client.processing() and any(client.processing().values()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(client.processing().values())  # the 2-second tasks were cancelled, not left running
