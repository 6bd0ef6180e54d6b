"""Two slots for CI's last step, in which three tools run at once and share the machine's cores.

.ci/run starts the listings check, the mutation check and the exercises' tests together, and lets
only two of their jobs (a listing file, a mistake, a test) run at a time, as GNU make's jobserver
does: a named pipe, which CI_SLOTS names, holds one byte per slot; a job reads one byte before it
starts and writes it back when it ends. So no tool ends on one long job while the other core waits
for the next tool. Without CI_SLOTS (a tool run by hand), a job takes no slot and starts at once.
"""

import contextlib
import os
import select
import threading
import time


class Slots:
    def __init__(self, path):
        self.pipe = os.open(path, os.O_RDWR | os.O_NONBLOCK) if path else None
        # While a job that needs several slots gathers them, this file exists, and no other job
        # takes a slot: else the others' jobs could keep it waiting, or two such jobs each hold
        # one slot and wait for the other's.
        self.claim = f"{path}.claimed"
        self.stopped = threading.Event()  # set when the tool stops: no waiting job starts then

    @contextlib.contextmanager
    def held(self, count=1):
        """Wait for count slots, hold them while the block runs, then give them back."""
        taken, claimed = b"", False
        try:
            while self.pipe is not None and len(taken) < count:
                if self.stopped.is_set():
                    raise RuntimeError("stopped while waiting for a slot")
                if count > 1 and not claimed:
                    claimed = self.try_claim()  # several slots: one such job gathers at a time
                # A job of several slots takes none before it holds the claim: two that each
                # took one while another's claim was ending would wait for each other forever.
                if not claimed and (count > 1 or os.path.exists(self.claim)):
                    time.sleep(0.2)  # another job is gathering slots: it goes first
                    continue
                select.select([self.pipe], [], [], 1)  # a free slot, or a second gone by
                with contextlib.suppress(BlockingIOError):  # another job took it first
                    taken += os.read(self.pipe, 1)
            if claimed:  # gathered: the others may take slots again
                os.remove(self.claim)
                claimed = False
            yield
        finally:
            if claimed:  # stopped while gathering
                os.remove(self.claim)
            if taken:
                os.write(self.pipe, taken)

    def try_claim(self):
        try:
            os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


# This process's slots. A tool that takes slots for the jobs it starts removes CI_SLOTS from its
# environment (os.environ.pop), so that a job's own processes do not wait for slots of their own.
SLOTS = Slots(os.environ.get("CI_SLOTS"))
