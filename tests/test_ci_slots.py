"""CI's two slots (tools/ci_slots.py), which its last step's three tools share."""

import os
import sys
import threading
import time

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ci_slots  # noqa: E402


@pytest.fixture
def pipe(tmp_path):
    """A named pipe holding two slots, as .ci/run makes it; yields (its path, CI's own end)."""
    path = tmp_path / "slots"
    os.mkfifo(path)
    ours = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    os.write(ours, b"++")
    yield path, ours
    os.close(ours)


def most_at_once(slots, counts):
    """Run one job per count, each holding that many slots for a moment: the most slots that
    the jobs running at one time held together."""
    running, most, lock = [0], [0], threading.Lock()

    def job(count):
        with slots.held(count):
            with lock:
                running[0] += count
                most[0] = max(most[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= count

    threads = [threading.Thread(target=job, args=(count,)) for count in counts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads), "a job never got its slot"
    return most[0]


def test_two_slots_run_two_jobs_at_a_time_and_every_slot_comes_back(pipe):
    path, ours = pipe
    slots = ci_slots.Slots(path)
    assert most_at_once(slots, [1] * 5) == 2
    assert most_at_once(slots, [2, 1, 1, 2]) == 2  # a job that holds both runs beside none
    assert most_at_once(slots, [2, 2, 2, 1]) == 2  # and two such jobs never hold one each
    assert os.read(ours, 10) == b"++"


def test_a_job_of_two_slots_takes_none_until_it_holds_the_claim(pipe, monkeypatch):
    # The moment CI once met: each of two such jobs finds the claim taken (try_claim fails), and
    # the other job's claim is gone by the time it looks again. A job that then took a slot
    # without the claim would hold one while the other held the other, both waiting forever.
    slots = ci_slots.Slots(pipe[0])
    try_claim, failed = slots.try_claim, set()

    def claim_taken_once():
        me = threading.get_ident()
        if me not in failed:
            failed.add(me)
            time.sleep(0.1)  # both have failed before either looks again
            return False
        return try_claim()

    monkeypatch.setattr(slots, "try_claim", claim_taken_once)
    assert most_at_once(slots, [2, 2]) == 2
    assert os.read(pipe[1], 10) == b"++"


def test_without_ci_slots_a_job_starts_at_once_and_a_stopped_tool_starts_none(pipe):
    assert most_at_once(ci_slots.Slots(None), [1] * 4) == 4
    slots = ci_slots.Slots(pipe[0])
    slots.stopped.set()
    with pytest.raises(RuntimeError, match="stopped while waiting for a slot"):
        with slots.held():
            pass
