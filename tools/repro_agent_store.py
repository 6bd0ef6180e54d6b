"""Reproduce why lesson 04 needs a fresh store per torchrun restart, and compare the fixes.

    python tools/repro_agent_store.py               # 4 jobs each way, at most 90 s per job
    python tools/repro_agent_store.py --jobs 8 --modes shared,switch
    python tools/repro_agent_store.py --nodes 2     # two c10d nodes on this machine

Each job is `torchrun --standalone --nproc-per-node 2 --max-restarts 1` on a small script that
joins a gloo group, all-reduces, lets rank 1 die in the first attempt (as lesson 04's
--crash-at-epoch does), and, in the restarted attempt, joins a new group and all-reduces again.
The modes differ only in how that group is joined:

  shared   init_process_group as in lesson 02. torchrun's agent hosts the store for the whole
           job and hands it to every attempt; the keys of the failed attempt are still there.
  prefix   lessons 04 and 07's workaround (restart_store): the same store behind
           PrefixStore(attempt number).
  switch   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment: PyTorch's own switch,
           with which each attempt's rank 0 hosts a fresh store.

With --nodes 2 a job is two torchrun "nodes" on this machine, one rank each, joined by the c10d
rendezvous on 127.0.0.1 (as lesson 03's Slurm script joins real nodes). Rank 1, on the second
node, dies; rank 0 is still busy, as a rank inside a collective on GPUs would be, when the
second node rejoins, and torchrun restarts the first node's rank for that without counting it
as a restart. TORCHELASTIC_RESTART_COUNT is then 0 on one node and 1 on the other, and "prefix"
puts the two ranks behind different prefixes. (Which attempt is the first is kept in a file, not
read from that count.)

A job that exits non-zero, or does not end within --timeout seconds, counts as failed. The
script prints the counts and exits 0. Every wait is bounded: the ranks' timeout is 20 s, and a
job still running at --timeout is killed with its process groups.
"""

import argparse
import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time

from bounded_wait import wait_all


def rank_main(mode):
    import torch
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    first = not os.path.exists(os.environ["REPRO_CRASHED"])  # the job's first attempt
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=20)
    store = None
    if mode == "prefix":
        agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.PrefixStore(
            f"attempt_{attempt}",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    total = torch.ones(1)
    dist.all_reduce(total)
    if first and rank == 1:
        open(os.environ["REPRO_CRASHED"], "w").close()
        os._exit(1)  # a crashed rank: torchrun stops the others and restarts the job
    if first:
        time.sleep(30)  # rank 0 waits to be stopped, as a rank in its next collective would
    dist.all_reduce(total)
    assert total.item() == 2 * world_size
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def start_job(mode, nodes, crashed):
    """torchrun --standalone with 2 ranks, or (nodes=2) two c10d nodes of 1 rank each."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["REPRO_CRASHED"] = crashed
    if mode == "switch":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    script = [__file__, "--rank", "shared" if mode == "switch" else mode]
    commands = [["--standalone", "--nproc-per-node", "2"]]
    if nodes == 2:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
        commands = [["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", endpoint, "--rdzv-id", "repro"]] * 2
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command,
                              "--max-restarts", "1", *script],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for command in commands]


def run_jobs(mode, jobs, timeout, nodes):
    failed, seconds = 0, []
    for _ in range(jobs):
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as folder:
            processes = start_job(mode, nodes, os.path.join(folder, "crashed"))
            err = wait_all(processes, timeout)
        if err is None:
            failed += 1
            print(f"  {mode}: a job did not end within {timeout:g} s (killed)", flush=True)
            continue
        seconds.append(time.monotonic() - start)
        returncode = next((p.returncode for p in processes if p.returncode), 0)
        if returncode != 0:
            failed += 1
            signs = ("Error", "refused", "failed to connect", "Timed out", "timed out")
            reasons = [line for line in err.splitlines() if any(sign in line for sign in signs)
                       and not line.lstrip().startswith(("frame #", "File "))]
            print(f"  {mode}: a job exited {returncode}: "
                  f"{(reasons or ['?'])[0].strip()[:160]}", flush=True)
    median = sorted(seconds)[len(seconds) // 2] if seconds else float("nan")
    print(f"{mode}: {failed} of {jobs} jobs failed after the restart (median job {median:.1f} s)",
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="jobs per mode")
    parser.add_argument("--timeout", type=float, default=90, help="seconds one job may take")
    parser.add_argument("--modes", default="shared,prefix,switch", help="which modes, in order")
    parser.add_argument("--nodes", type=int, default=1, choices=[1, 2],
                        help="1: torchrun --standalone; 2: two c10d nodes on this machine")
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # internal: torchrun runs this
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank)
        return
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.nodes} node(s); "
          f"{args.jobs} jobs per mode", flush=True)
    for mode in args.modes.split(","):
        run_jobs(mode, args.jobs, args.timeout, args.nodes)


if __name__ == "__main__":
    main()
