"""What the repro tools share: wait for a run's processes, each started in a process group of
its own (start_new_session=True), and kill whatever is left when the run's time is up."""

import os
import signal
import subprocess
import time


def wait_all(processes, timeout):
    """The processes' stderr, joined, once every one has ended within timeout seconds; None if
    the time ran out first, after every process group was killed (SIGKILL)."""
    deadline = time.monotonic() + timeout
    try:
        return "".join(process.communicate(timeout=max(1, deadline - time.monotonic()))[1]
                       for process in processes)
    except subprocess.TimeoutExpired:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it had ended already
            process.wait()
        return None
