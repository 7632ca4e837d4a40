"""The decoding loop's draft timer on a stand-in accelerator whose work is only visible after a
synchronize (issue 51, finding 8: a synchronize around every draft tilted the race)."""

from __future__ import annotations

import time

import pytest

from draftsmith.train.device import IntervalTimer


class QueueDevice:
    """An accelerator's queue: a launch returns at once, the work runs after what was queued
    before it, and only ``synchronize`` waits for it (counted)."""

    def __init__(self) -> None:
        self.busy_until = time.perf_counter()
        self.syncs = 0

    def launch(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, time.perf_counter()) + seconds

    def synchronize(self) -> None:
        self.syncs += 1
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))

    def event(self) -> Event:
        return Event(self)


class Event:
    """A timing event: ``record`` marks the queue's position (when the work before it ends)."""

    def __init__(self, device: QueueDevice) -> None:
        self.device = device
        self.at: float | None = None

    def record(self) -> None:
        self.at = max(self.device.busy_until, time.perf_counter())

    def elapsed_time(self, end: Event) -> float:
        assert self.device.busy_until <= time.perf_counter(), "read before the work finished"
        return 1000 * (end.at - self.at)


def test_intervals_count_queued_work_with_one_synchronize():
    dev = QueueDevice()
    timer = IntervalTimer("cuda", event=dev.event, sync=dev.synchronize)
    host = time.perf_counter()
    for seconds in (0.03, 0.02, 0.04):  # three drafts, each followed by unrelated work
        mark = timer.start()
        dev.launch(seconds)
        timer.stop(mark)
        dev.launch(0.01)  # the verify forward: queued, not timed
    host = time.perf_counter() - host
    assert host < 0.02  # the host never waited: no synchronize inside the intervals
    assert dev.syncs == 0
    total = timer.total()
    assert dev.syncs == 1
    assert total == pytest.approx(0.09, abs=0.01)
    # A host clock around the same launches (no events, no synchronize) would have read ~0.
    assert total > 4 * host


def test_the_cpu_times_on_the_host_clock():
    timer = IntervalTimer("cpu")
    mark = timer.start()
    time.sleep(0.02)
    timer.stop(mark)
    assert timer.total() == pytest.approx(0.02, abs=0.015)
