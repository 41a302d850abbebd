"""A world runs one operation at a time: a second thread entering it fails at once, and the
operation in flight fails too (its result may have been paired with the other thread's call).

Every test runs on both guards: the compiled one (``meshcomm.api._callpath``, what a world
runs by default) and the pure-Python one (``MESHCOMM_COMPILED=0``, and where no compiled one
is installed)."""

from __future__ import annotations

import threading

import meshcomm as mc
import numpy as np
import pytest
from meshcomm.api.guard import WorldGuard, compiled_guard, new_guard
from meshcomm.testing.threaded import make_threaded_groups


@pytest.fixture(params=[True, False], ids=["compiled", "python"])
def compiled(request: pytest.FixtureRequest) -> bool:
    """Which guard the test's worlds run; the checkout's install must have the compiled one
    (scripts/setup.sh builds it, as the wheel carries it)."""
    if request.param:
        assert compiled_guard() is not None, "no compiled call path in this install: run scripts/setup.sh"
    return bool(request.param)


def test_the_setting_picks_the_guard():
    assert type(new_guard(True)) is compiled_guard()
    assert type(new_guard(False)) is WorldGuard


def test_second_thread_is_refused_and_the_call_in_flight_discarded(compiled):
    g0, g1 = make_threaded_groups(2, timeout=10, compiled=compiled)
    inside = threading.Event()
    outcome = {}

    def blocked_recv():
        inside.set()
        try:
            outcome["recv"] = mc.recv((3,), np.float64, 1, group=g0)
        except mc.DistributedError as exc:
            outcome["recv"] = exc

    t = threading.Thread(target=blocked_recv, name="receiver")
    t.start()
    inside.wait(5)
    # rank 0 is inside recv on thread "receiver": another thread's call on the world fails at once
    with pytest.raises(mc.DistributedError, match=r"thread 'MainThread' while thread 'receiver' is inside recv"):
        mc.all_sum(np.ones(2), group=g0)
    sub = None
    with pytest.raises(mc.DistributedError, match="one operation at a time"):
        sub = g0.split(0)  # a split shares the world's guard
    assert sub is None
    mc.send(np.arange(3.0), 0, group=g1)
    t.join(10)
    err = outcome["recv"]
    assert isinstance(err, mc.DistributedError), f"the in-flight recv returned {err!r}"
    assert "is discarded" in str(err) and "thread 'MainThread' called all_sum" in str(err)


def test_world_is_usable_again_after_a_refusal(compiled):
    g0, g1 = make_threaded_groups(2, timeout=10, compiled=compiled)
    out = {}

    def rank1():
        out[1] = mc.all_sum(np.ones(2), group=g1)

    t = threading.Thread(target=rank1)
    t.start()
    out[0] = mc.all_sum(np.ones(2), group=g0)
    t.join(10)
    np.testing.assert_array_equal(out[0], [2, 2])
    np.testing.assert_array_equal(out[1], [2, 2])


def test_two_threads_per_rank_never_return_wrong_sums(compiled):
    """Both ranks run two threads that each call all_sum with their own values many times:
    every call either returns the exact sum of that thread's values or raises. (The call
    check is off so that only the guard stands between the threads' messages.)"""
    groups = make_threaded_groups(2, timeout=5, check_calls=False, compiled=compiled)
    wrong, errors, right = [], [], []
    lock = threading.Lock()

    def worker(g, value):
        for _ in range(200):
            try:
                got = mc.all_sum(np.full(4, value, np.float64), group=g)
            except mc.DistributedError:
                with lock:
                    errors.append(1)
                return  # after a refusal this job's pairing is broken: stop like a user would
            with lock:
                (right if np.all(got == 2 * value) else wrong).append(got)

    threads = [threading.Thread(target=worker, args=(g, v)) for g in groups for v in (1.0, 100.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not wrong, f"wrong sums returned: {wrong[:3]}"
    assert errors, "the threads never overlapped: the test did not test anything"


def test_the_guard_discards_exactly_the_operations_in_flight_when_another_thread_intruded(compiled):
    """The guard's bookkeeping alone (no ranks): tickets issued before an intrusion and
    still in flight raise when they end well; one issued after it, or one that failed
    anyway, does not; once idle, any thread may enter."""
    guard = new_guard(compiled)
    first = guard.enter("all_sum", "rank 0")
    second = guard.enter("broadcast", "rank 0")  # the same thread may queue more (async_op)
    refused = {}

    def intrude():
        try:
            guard.enter("barrier", "rank 0")
        except mc.DistributedError as exc:
            refused["error"] = str(exc)

    t = threading.Thread(target=intrude, name="intruder")
    t.start()
    t.join()
    assert "from thread 'intruder' while thread 'MainThread' is inside all_sum" in refused["error"]
    third = guard.enter("all_gather", "rank 0")  # issued after the intrusion: its peers saw no mix-up
    guard.leave(second, "broadcast", "rank 0", False)  # failed anyway: its own error stands
    with pytest.raises(
        mc.DistributedError,
        match=r"result of all_sum \(thread 'MainThread'\) is discarded: "
        r"thread 'intruder' called barrier",
    ):
        guard.leave(first, "all_sum", "rank 0", True)
    guard.leave(third, "all_gather", "rank 0", True)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("ticket", guard.enter("barrier", "rank 0")))
    t.start()
    t.join()
    guard.leave(done["ticket"], "barrier", "rank 0", True)  # idle again: another thread is welcome


def test_without_the_compiled_module_worlds_run_the_python_guard(monkeypatch):
    """An installation built without a C compiler has no ``_callpath``: new worlds get the
    pure-Python guard, whatever MESHCOMM_COMPILED says, and ``meshcomm info`` says so."""
    import sys

    from meshcomm.cli import _call_path

    monkeypatch.setitem(sys.modules, "meshcomm.api._callpath", None)  # import raises ImportError
    assert compiled_guard() is None
    assert type(new_guard(True)) is WorldGuard
    assert _call_path() == "pure-Python call path: this installation has no compiled one"
