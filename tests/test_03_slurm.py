"""Lesson 03 under Slurm: the lesson's sbatch script on a real two-node cluster on this machine.

03_multi_node/slurm/local_cluster.sh starts munged, slurmctld and one slurmd in each of two
network namespaces (node1, node2); the tests submit 03_multi_node/slurm/train.sbatch with
`sbatch --wait`, as a learner would, and check what the job printed and wrote. The nodes share
this machine's filesystem, so pytest's temporary folders are visible to both.

Skipped, with the reason, where the cluster cannot run: not root, Slurm or munge not installed
(`apt-get install slurm-wlm munge`), network namespaces unusable, or a local cluster already
running (the tests would end its jobs).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import ROOT, evaluate_single_process, read_metrics

CLUSTER = ROOT / "03_multi_node" / "slurm" / "local_cluster.sh"
SBATCH_SCRIPT = "03_multi_node/slurm/train.sbatch"  # relative: sbatch runs from the repo root
# The daemons live in sbin, which a non-login shell's PATH may lack. The virtual environment's
# bin comes first, as it does for a learner who activated it: the job finds torchrun there.
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""),
                        "/usr/sbin", "/sbin"])


def reason_to_skip():
    """Why the local cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (network namespaces, a bridge, daemons)"
    missing = [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch")
               if not shutil.which(tool, path=PATH)]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge"
    if Path("/run/netns/ddp-node1").exists():
        return "a local Slurm cluster is already running; stop it with local_cluster.sh stop"
    # Creating and deleting a namespace is the one sure test that namespaces work here.
    probe = f"ddp-probe-{os.getpid()}"
    if shutil.which("ip", path=PATH) is None:
        return "the ip command (iproute2) is not installed"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          env={**os.environ, "PATH": PATH})
    if made.returncode != 0:
        return f"network namespaces are unusable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], env={**os.environ, "PATH": PATH})
    return None


def log_tails(state_dir, lines=20):
    """The end of every daemon log, for a failure message that shows what Slurm said."""
    tails = []
    for log in sorted((Path(state_dir) / "logs").glob("*.log")):
        tails.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-lines:]))
    return "\n".join(tails)


@pytest.fixture(scope="module")
def cluster():
    """Start the local cluster once for this file and stop it afterwards, whatever happened.

    Yields the environment a learner's shell would have: SLURM_CONF set, venv on PATH."""
    reason = reason_to_skip()
    if reason:
        pytest.skip(reason)
    # Not under pytest's temporary folder: munged wants every folder above its socket to be
    # open to all users, and pytest makes its own private (0700).
    state_dir = Path(tempfile.mkdtemp(prefix="ddp-slurm-test-"))
    env = {**os.environ, "PATH": PATH, "DDP_SLURM_DIR": str(state_dir),
           "SLURM_CONF": str(state_dir / "slurm.conf"), "PYTHONUNBUFFERED": "1"}
    # A NPROC_PER_NODE or Slurm variable left in the caller's shell would change the job.
    env.pop("NPROC_PER_NODE", None)
    for name in [name for name in env if name.startswith(("SLURM_JOB", "SBATCH_", "SRUN_"))]:
        del env[name]
    try:
        started = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True,
                                 text=True, timeout=120)
        assert started.returncode == 0, (f"local_cluster.sh start failed:\n{started.stdout}\n"
                                         f"{started.stderr}\n{log_tails(state_dir)}")
        yield env
    finally:
        stopped = subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True,
                                 text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        # stop keeps the logs for a person to read; a failed test has already quoted them.
        shutil.rmtree(state_dir, ignore_errors=True)


def submit(env, out_file_dir, *args, timeout=240):
    """`sbatch --wait train.sbatch args...` from the repository root, as a learner runs it.

    Returns (sbatch's exit code, the job's output). The job's output file goes to out_file_dir
    rather than the repository root, named as the script names it (%x-%j.out)."""
    command = ["sbatch", "--wait", f"--output={out_file_dir}/%x-%j.out", SBATCH_SCRIPT,
               *map(str, args)]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--user=root"], env=env)
        raise
    submitted = re.search(r"Submitted batch job (\d+)", result.stdout)
    assert submitted, f"sbatch did not submit:\n{result.stdout}\n{result.stderr}"
    output_file = Path(out_file_dir) / f"ddp-lesson03-{submitted.group(1)}.out"
    assert output_file.is_file(), f"no job output {output_file}:\n{result.stderr}"
    return result.returncode, output_file.read_text()


def test_sbatch_trains_across_two_nodes(cluster, tmp_path):
    out_dir = tmp_path / "run"
    returncode, output = submit(cluster, tmp_path, "--epochs", 5, "--out-dir", out_dir)
    assert returncode == 0, f"{output}\n{log_tails(cluster['DDP_SLURM_DIR'])}"
    # Global rank 0 alone prints the summary, though four ranks on two nodes ran.
    assert output.count("test accuracy:") == 1, output
    metrics = read_metrics(out_dir)
    assert metrics["world_size"] == 4, metrics  # 2 nodes x 2 processes
    assert metrics["test_total"] == 36
    # final.pt is the trained model: scored by one plain process, it gets what the job reported.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    # Every rank's numbers, gathered by the lesson (rank_table): a run without them fails here.
    ranks = metrics["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], ranks
    assert {r["node_rank"] for r in ranks} == {0, 1}, ranks
    assert sorted(r["local_rank"] for r in ranks) == [0, 0, 1, 1], ranks
    # Each node is its own host: the two node ranks ran under two different hostnames.
    hosts = {r["node_rank"]: {x["host"] for x in ranks if x["node_rank"] == r["node_rank"]}
             for r in ranks}
    assert all(len(names) == 1 for names in hosts.values()), ranks
    assert hosts[0] != hosts[1], ranks


def test_failing_training_fails_the_job(cluster, tmp_path):
    # sbatch --wait reports the job's exit code: a training that fails must not look like a
    # success, and the job's output says so in the script's own words.
    returncode, output = submit(cluster, tmp_path, "--epochs", 0, "--out-dir", tmp_path / "run")
    assert returncode != 0, output
    assert "error: training failed" in output, output
    assert not (tmp_path / "run" / "metrics.json").exists()


# Holds a port in the network namespace it runs in until its stdin closes, as another job's
# rendezvous would; it hangs up on whoever connects, so a job that tries to use the port fails
# at once rather than waiting for an answer.
HOLD_PORT = """
import socket, sys, threading
server = socket.socket()
server.bind(("", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
def hang_up():
    while True:
        server.accept()[0].close()
threading.Thread(target=hang_up, daemon=True).start()
sys.stdin.read()
"""
# An nvidia-smi that lists 4 GPUs: a GPU node's, where the job asked Slurm for none.
FOUR_GPUS = "#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n"


def next_job_id(env):
    """The id Slurm gives the next job: a job submitted on hold, then cancelled, is the one
    before it (job ids count up by one)."""
    held = subprocess.run(["sbatch", "--hold", "--parsable", "--wrap", "true"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=30)
    assert held.returncode == 0, held.stderr
    job_id = int(held.stdout.strip().split(";")[0])
    subprocess.run(["scancel", str(job_id)], env=env, timeout=30)
    return job_id + 1


def test_a_job_uses_only_what_it_asked_for_on_a_shared_gpu_node(cluster, tmp_path):
    # Two things of other jobs on the same nodes, which this job must leave alone:
    # - GPUs: the nodes have 4 (an nvidia-smi that lists them is on the PATH), but the job
    #   asked Slurm for none (no --gres). It must run the CPU default, 2 gloo processes a node.
    # - A port: a process on the first node, where the rendezvous runs, listens on the port
    #   29500 + job id % 1000, as another job 1000 ids before this one would. The job must
    #   find a free port instead, not fail on a busy one.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FOUR_GPUS)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**cluster, "PATH": f"{bin_dir}{os.pathsep}{cluster['PATH']}"}
    job_id = next_job_id(env)
    busy_port = 29500 + job_id % 1000
    holder = subprocess.Popen(["ip", "netns", "exec", "ddp-node1", sys.executable, "-c",
                               HOLD_PORT, str(busy_port)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "listening"
        returncode, output = submit(env, tmp_path, "--epochs", 2, "--out-dir", tmp_path / "run")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert f"job {job_id}: " in output, output  # the job whose port was taken
    assert returncode == 0, f"{output}\n{log_tails(cluster['DDP_SLURM_DIR'])}"
    port = int(re.search(r"rendezvous at [\d.]+:(\d+)", output).group(1))
    assert port != busy_port
    assert "x 2 processes, 0 GPU(s) a node, backend gloo" in output
    metrics = read_metrics(tmp_path / "run")
    assert (metrics["world_size"], metrics["backend"]) == (4, "gloo")
