"""Repro: under a long TMPDIR, the forkserver start method fails with "AF_UNIX path too long".

    python tools/repro_forkserver_tmpdir.py

The fork server that lesson 02's start_ranks uses listens on a Unix socket at
$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a socket's path holds at most 107 bytes on Linux
(103 on macOS). This starts one process with start_method="forkserver", first under a TMPDIR of
90 characters, then with the workaround every lesson's guard_rails.spawn_guard applies
(tempfile.tempdir = "/tmp" in the launcher). Upstream: https://github.com/python/cpython/issues/132124
(Python's own fix falls back to /tmp in the same way); where that fix is in, both lines say ok.
"""

import os
import subprocess
import sys
import tempfile

import torch.multiprocessing as mp


def child(rank):
    pass


def start(tempdir):
    """One process started by the fork server, with the launcher's temporary folder tempdir:
    multiprocessing picks its socket's folder once per process, so each case is a process."""
    tempfile.tempdir = tempdir  # what TMPDIR=tempdir gives, or the workaround
    try:
        mp.start_processes(child, nprocs=1, start_method="forkserver")
        return "ok"
    except OSError as error:
        return str(error)


if __name__ == "__main__":
    if len(sys.argv) == 2:
        print(start(sys.argv[1]))
        sys.exit()
    if "forkserver" not in mp.get_all_start_methods():
        sys.exit("no forkserver start method here (Windows): nothing to show")
    with tempfile.TemporaryDirectory() as base:
        long_dir = os.path.join(base, "x" * (90 - len(base) - 1))
        os.makedirs(long_dir)
        for label, tempdir in [(f"TMPDIR of {len(long_dir)} characters", long_dir),
                               ("the socket under /tmp (guard_rails' workaround)", "/tmp")]:
            result = subprocess.run([sys.executable, __file__, tempdir], capture_output=True,
                                    text=True)
            print(f"{label}: {(result.stdout + result.stderr).strip().splitlines()[-1]}")
