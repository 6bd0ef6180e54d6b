"""Troubleshooting: "address already in use" when the job starts.

Rank 0 listens on MASTER_PORT for the other ranks to find it. If something already listens there,
often an earlier run that is still alive, or another learner's job on a shared machine, rank 0
cannot and the job stops at start-up. This occupies a port, starts a process group on it, then
on a free port from the operating system, which is what the lessons do. See TROUBLESHOOTING.md.

    python troubleshooting/port_in_use.py
"""

import datetime
import os
import socket

import torch.distributed as dist


def start_group(port):
    """A group of one process with rank 0 listening on port: enough to meet the error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=5))
    dist.destroy_process_group()


def main():
    # The earlier run that never ended: a server listening on a port.
    with socket.socket() as earlier_run:
        earlier_run.bind(("127.0.0.1", 0))
        earlier_run.listen()
        busy = earlier_run.getsockname()[1]
        try:
            start_group(busy)
        except dist.DistNetworkError as error:
            print(f"init_process_group with MASTER_PORT={busy} raised "
                  f"{type(error).__name__}:\n  {error}")
            print(f"symptom: port {busy} is already in use, so rank 0 cannot listen there")
        else:
            print(f"(no error: this system let a second server listen on port {busy})")

        # Port 0 asks the operating system for a port nobody uses, as the lessons do when
        # MASTER_PORT is not set. (Or find who holds the port: ss -ltnp | grep PORT.)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        start_group(free)
        print(f"fix: a free port from the operating system ({free}): the group started")


if __name__ == "__main__":
    main()
