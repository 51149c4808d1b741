"""The client's future (``Pending``) behaves as a ``concurrent.futures.Future`` in
every respect a caller can see, though its condition is made only when needed:
results and failures, callbacks before and after, ``concurrent.futures.wait``,
a second thread blocked on it, cancelling, and setting twice."""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait

import pytest

from gradhub.ps.client.pending import Pending, all_of


class _Idle:
    """A channel with nothing to drive: a waiter falls back on the future's condition."""

    def __init__(self) -> None:
        self.drives = 0

    def wait(self, future: Pending, timeout: float | None) -> None:
        self.drives += 1


def _later(action: object, delay: float = 0.1) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), action()))  # type: ignore[operator]
    thread.start()
    return thread


def test_set_and_read_by_one_thread_needs_no_condition() -> None:
    future = Pending(_Idle())
    assert not future.done() and not future.finished
    future.set_result(None)
    assert future.done() and future.finished and future.result() is None
    assert "_made" not in future.__dict__  # the common case never made one
    with pytest.raises(InvalidStateError):
        future.set_result(None)


def test_a_thread_blocked_on_it_is_woken_and_callbacks_run_once() -> None:
    channel = _Idle()
    future = Pending(channel)
    seen: list[object] = []
    future.add_done_callback(lambda f: seen.append(("before", f.result())))
    thread = _later(lambda: future.set_result(None))
    assert future.result(timeout=10) is None  # blocked on the condition, then woken
    thread.join()
    future.add_done_callback(lambda f: seen.append(("after", f.result())))
    assert seen == [("before", None), ("after", None)] and channel.drives == 1


def test_concurrent_futures_wait_sees_it_complete() -> None:
    futures = [Pending(_Idle()), Pending(_Idle())]
    thread = _later(lambda: futures[1].set_result(None))
    done, not_done = wait(futures, timeout=10, return_when=FIRST_COMPLETED)
    thread.join()
    assert done == {futures[1]} and not_done == {futures[0]}
    futures[0].set_result(None)
    assert wait(futures, timeout=10).not_done == set()


def test_failure_cancel_and_all_of_as_future_does() -> None:
    failed = Pending(_Idle())
    failed.set_exception(ValueError("refused"))
    assert failed.finished and isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError, match="refused"):
        failed.result()
    cancelled = Pending(_Idle())
    assert cancelled.cancel() and cancelled.finished and cancelled.cancelled()
    with pytest.raises(InvalidStateError):
        cancelled.set_result(None)
    parts = [Pending(_Idle()), Pending(_Idle())]
    joined = all_of(_Idle(), list[Future[None]](parts))
    parts[0].set_result(None)
    assert not joined.done()
    parts[1].set_result(None)
    assert joined.done() and joined.result() is None
