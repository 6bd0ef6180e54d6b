"""Troubleshooting: every rank downloads or prepares the same data file at once.

When every rank runs "download the data if it is not there yet", the first rank starts writing
the file, and a rank that arrives a moment later finds it there, half written, and reads it (or
writes it again over the first one's). The fix: one rank prepares the file, writing it under a
temporary name and renaming it when it is complete, while the others wait at dist.barrier();
then every rank reads it. Here the "download" writes a torch.save file in 20 chunks; in the
symptom rank 1 arrives when half of them are written. The order is forced (with two events) so
that every run shows it; in a real job it is whatever the machine makes it. See
TROUBLESHOOTING.md.

    python troubleshooting/download_once.py
"""

import datetime
import io
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# For forming the group: two fresh processes may take several seconds apart to import torch.
START = datetime.timedelta(seconds=60)
SAMPLES, CHUNKS = 1000, 20
WAIT = 30  # seconds a rank waits for the other's event at most: every wait here is bounded


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def download(path, halfway=lambda: None):
    """A stand-in for a download: the data set arrives in chunks and is written as they come."""
    buffer = io.BytesIO()
    torch.manual_seed(0)
    torch.save({"features": torch.randn(SAMPLES, 13)}, buffer)
    data = buffer.getvalue()
    size = -(-len(data) // CHUNKS)
    with open(path, "wb") as file:
        for i in range(CHUNKS):
            file.write(data[i * size:(i + 1) * size])
            file.flush()  # the bytes so far are in the file, for any other process to read
            time.sleep(0.05)  # the network
            if i + 1 == CHUNKS // 2:
                halfway()


def read(path):
    return torch.load(path, weights_only=True)["features"]


def every_rank_prepares(rank, path, half_written, rank1_looked):
    """The bug: every rank runs "download it unless it is there", then reads it."""
    def let_rank_1_look():  # the forced order: rank 1 looks when half the file is written
        half_written.set()
        rank1_looked.wait(WAIT)

    if rank == 1:
        half_written.wait(WAIT)  # rank 1 arrives while rank 0's download is under way
    try:
        if not os.path.exists(path):
            download(path, halfway=let_rank_1_look)
        features = read(path)
        say(f"rank {rank} read {len(features)} samples")
    except Exception as error:
        say(f"rank {rank} read the file at {os.path.getsize(path)} bytes and torch.load raised "
            f"{type(error).__name__}: {error}")
    finally:
        if rank == 1:
            rank1_looked.set()


def one_rank_prepares(rank, path):
    """The fix: rank 0 prepares, under a temporary name; the others wait at the barrier."""
    start = time.monotonic()
    if rank == 0 and not os.path.exists(path):  # local rank 0 if the nodes do not share a disk
        download(f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # the name appears only once the file is complete
    dist.barrier()  # every rank waits here until rank 0 is done
    waited = time.monotonic() - start
    return read(path), waited


def worker(rank, folder, half_written, rank1_looked):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=START)
    dist.barrier()  # start the symptom together
    every_rank_prepares(rank, os.path.join(folder, "naive.pt"), half_written, rank1_looked)
    dist.barrier()
    if rank == 0:
        say(f"symptom: rank 1 found the file that rank 0 was still writing ({CHUNKS // 2} of "
            f"{CHUNKS} chunks), so it skipped the download and read half a file")

    features, waited = one_rank_prepares(rank, os.path.join(folder, "once.pt"))
    say(f"  rank {rank}: {len(features)} samples, after {waited:.1f} s "
        f"{'downloading' if rank == 0 else 'waiting at dist.barrier()'}")
    everyone = [torch.zeros(SAMPLES, 13) for _ in range(2)]
    dist.all_gather(everyone, features)
    if rank == 0 and torch.equal(everyone[0], everyone[1]):
        say("fix: rank 0 downloaded to once.pt.tmp and renamed it; rank 1 waited at the "
            f"barrier; both read the same {SAMPLES} samples")
    dist.destroy_process_group()
    # Leave at once, as the lessons do (leave_process in guard_rails.py): gloo's threads can abort
    # Python's teardown of a finished rank (notes/teardown_abort.md, pytorch/pytorch#190489).
    sys.stdout.flush()
    os._exit(0)


def main():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Two events fix the order of the symptom: rank 1 looks when half the file is written, and
    # rank 0 writes the rest once rank 1 has looked.
    events = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(folder, events.Event(), events.Event()), nprocs=2)


if __name__ == "__main__":
    main()
