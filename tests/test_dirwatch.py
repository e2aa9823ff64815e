"""``faults.dirwatch.wait_until``: woken by the deletion itself (inotify), never by a timed loop."""

from __future__ import annotations

import os
import threading
import time

from faults.dirwatch import wait_until


def test_wakes_on_the_deletion_made_after_the_watch_is_armed(tmp_path):
    victim = tmp_path / "global_step_1"
    victim.mkdir()
    armed, calls = threading.Event(), []

    def predicate() -> bool:
        calls.append(1)
        gone = not victim.exists()
        # Only once this check has looked may the deletion happen (setting the event before looking
        # let the deleter win that race, and the first check saw it gone: one call, not two). The first
        # check runs after the watch is set, so the deletion that follows cannot be missed.
        armed.set()
        return gone

    t = threading.Thread(target=lambda: (armed.wait(), os.rmdir(victim)))
    t.start()
    t0 = time.monotonic()
    assert wait_until(str(tmp_path), predicate, timeout=60)
    t.join()
    assert time.monotonic() - t0 < 30  # woken by the event, not by the deadline
    assert len(calls) >= 2  # checked before waiting, and again on the event


def test_a_change_already_made_is_seen_and_a_condition_never_met_times_out(tmp_path):
    assert wait_until(str(tmp_path), lambda: True, timeout=0)
    t0 = time.monotonic()
    assert not wait_until(str(tmp_path), lambda: False, timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
