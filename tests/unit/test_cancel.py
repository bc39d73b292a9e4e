"""Stopping a run's attempts from another thread: each watching attempt's stop is called once,
one that starts watching after the cancel at once, none after its block ended."""

from __future__ import annotations

import threading

from spark_torch.driver.run.cancel import Cancellation, RunCancelled


def test_a_cancel_stops_every_watching_attempt_once_with_its_error() -> None:
    cancellation = Cancellation()
    stopped: list[str] = []
    error = RunCancelled("stopped: replica group 1 failed the run")
    with cancellation.watch(lambda: stopped.append("a")), cancellation.watch(lambda: stopped.append("b")):
        assert cancellation.error is None
        thread = threading.Thread(target=cancellation.cancel, args=(error,))
        thread.start()
        thread.join()
        cancellation.cancel(KeyboardInterrupt())  # a second cancel changes nothing
    assert sorted(stopped) == ["a", "b"] and cancellation.error is error


def test_an_attempt_that_starts_after_the_cancel_is_stopped_at_once() -> None:
    cancellation = Cancellation()
    cancellation.cancel(KeyboardInterrupt())
    stopped: list[int] = []
    with cancellation.watch(lambda: stopped.append(1)):
        assert stopped == [1]
    assert isinstance(cancellation.error, KeyboardInterrupt)


def test_an_attempt_that_ended_is_not_stopped() -> None:
    cancellation = Cancellation()
    stopped: list[int] = []
    with cancellation.watch(lambda: stopped.append(1)):
        pass
    cancellation.cancel(RunCancelled("stopped"))
    assert stopped == []
