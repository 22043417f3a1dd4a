"""Signals during a run's completion loop are taken at a safe point (cachescore.pipeline.interrupts)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from cachescore.errors import RunInterrupted
from cachescore.pipeline.interrupts import DeferredInterrupts


def _send(sig) -> None:
    os.kill(os.getpid(), sig)  # the handler runs in the main thread before the next bytecode


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_is_held_until_the_safe_point(sig):
    before = signal.getsignal(sig)
    with pytest.raises(RunInterrupted) as info:
        with DeferredInterrupts() as interrupts:
            _send(sig)
            reached = True  # nothing raised in between
            interrupts.check()
    assert reached and info.value.signum == sig
    assert signal.getsignal(sig) is before


def test_a_second_signal_raises_at_once():
    with pytest.raises(RunInterrupted) as info:
        with DeferredInterrupts():
            _send(signal.SIGTERM)
            _send(signal.SIGINT)
            pytest.fail("the second signal did not raise")
    assert info.value.signum == signal.SIGTERM  # the first one names the interruption


def test_a_pending_signal_is_raised_on_exit_and_none_without_one():
    with DeferredInterrupts() as interrupts:
        interrupts.check()  # nothing came: no exception
    with pytest.raises(RunInterrupted):
        with DeferredInterrupts():
            _send(signal.SIGINT)
    with pytest.raises(ValueError, match="own"):  # an exception already leaving the block wins
        with DeferredInterrupts():
            _send(signal.SIGINT)
            raise ValueError("its own error")


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with DeferredInterrupts() as interrupts:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            _send(signal.SIGINT)
            interrupts.check()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_nothing_changes():
    seen = {}

    def body():
        handler = signal.getsignal(signal.SIGINT)
        with DeferredInterrupts() as interrupts:
            seen["same"] = signal.getsignal(signal.SIGINT) is handler
            interrupts.check()
        seen["ok"] = True

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"same": True, "ok": True}


def test_an_owned_cluster_is_quieted_before_teardown_and_an_external_one_is_not():
    """An early end quiets distributed's logs on the workers of a cluster the run started (they
    would print cancelled-task tracebacks while torn down) and here until the client is closed;
    the workers behind an external scheduler are not the run's to quiet."""
    import logging

    from distributed import Client, LocalCluster

    from cachescore.pipeline.logs import quiet_owned_cluster, restore_logs

    def worker_level():
        return logging.getLogger("distributed.worker").getEffectiveLevel()

    before = worker_level()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      host="127.0.0.1") as cluster:
        with Client(cluster.scheduler_address, set_as_default=False) as external:
            assert external.cluster is None
            quiet_owned_cluster(external)
            assert worker_level() == before
            assert set(external.run(worker_level).values()) == {before}
        with Client(cluster, set_as_default=False) as owned:
            quiet_owned_cluster(owned)
            assert worker_level() == logging.CRITICAL
            assert set(owned.run(worker_level).values()) == {logging.CRITICAL}
    restore_logs()
    assert worker_level() == before
