"""A group's worker: one operation at a time, in order; in place where that is the same."""

from __future__ import annotations

import threading

import torch

from gradhub.transports.worker import Worker


def test_call_runs_on_the_calling_thread_when_idle() -> None:
    worker = Worker(0)
    try:
        assert worker.call("op", 10, threading.get_ident) == threading.get_ident()
    finally:
        worker.shutdown()


def test_call_waits_for_the_operations_queued_before_it() -> None:
    worker = Worker(0)
    release, order = threading.Event(), []

    def first() -> None:
        assert release.wait(10)
        order.append("first")

    try:
        future = worker.submit("first", 10, first)
        threading.Timer(0.2, release.set).start()
        ident = worker.call("second", 10, lambda: order.append("second") or threading.get_ident())
        future.wait()
        assert order == ["first", "second"]
        assert ident != threading.get_ident()  # queued behind the first: on the worker
    finally:
        worker.shutdown()


def test_an_operation_submitted_meanwhile_waits_for_one_running_in_place() -> None:
    worker = Worker(0)
    order: list[str] = []
    queued = threading.Event()

    def in_place() -> None:
        submitter = threading.Thread(
            target=lambda: (worker.submit("later", 10, lambda: order.append("later")), queued.set())
        )
        submitter.start()
        assert queued.wait(10)
        order.append("in place")  # the later one must not have run yet

    try:
        worker.call("in place", 10, in_place)
        worker.shutdown()  # finishes the queued one
        assert order == ["in place", "later"]
    finally:
        worker.shutdown()


def test_a_thread_in_another_torch_state_hands_the_operation_to_the_worker() -> None:
    worker = Worker(0)
    try:
        with torch.no_grad():
            # on the worker grad mode is on, as on any new thread
            assert worker.call("op", 10, torch.is_grad_enabled) is True
        with torch.inference_mode():
            assert worker.call("op", 10, torch.is_inference_mode_enabled) is False
    finally:
        worker.shutdown()


def test_a_group_of_one_rank_runs_a_submitted_operation_at_once_in_place() -> None:
    worker = Worker(0, alone=True)
    try:
        with torch.no_grad():  # as in a backward hook: the body still runs with grad on
            future = worker.submit(
                "op", 10, lambda: (threading.get_ident(), torch.is_grad_enabled())
            )
        assert future.done()
        assert future.wait() == (threading.get_ident(), True)
        failed = worker.submit("bad", 10, lambda: 1 / 0)
        assert failed.done()
        try:
            failed.wait()
        except ZeroDivisionError:
            pass
        else:
            raise AssertionError("the operation's error must come from wait()")
    finally:
        worker.shutdown()


def test_a_group_of_one_rank_queues_behind_an_operation_still_running() -> None:
    worker = Worker(0, alone=True)
    release, order = threading.Event(), []

    def first() -> None:
        assert release.wait(10)
        order.append("first")

    try:
        with torch.inference_mode():  # not a fresh thread's state: on the worker
            slow = worker.submit("first", 10, first)
        later = worker.submit("second", 10, lambda: order.append("second"))
        assert not later.done()
        release.set()
        slow.wait()
        later.wait()
        assert order == ["first", "second"]
    finally:
        worker.shutdown()
