"""Lesson 03, run as a learner runs it: one command per node, by hand and with torchrun.

Two "nodes" are two launches on this machine; then two real hosts, each in its own Linux network
namespace, joined by a veth pair. The Slurm cluster is in test_03_slurm.py, the GPU tier in
test_gpu.py."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import (
    ROOT,
    assert_good_run,
    assert_one_line_error,
    evaluate_single_process,
    free_port,
    import_lesson,
    lesson02_run,
    max_weight_difference,
    run_lesson,
    run_nodes,
    run_torchrun,
)

LESSON = "03_multi_node"
SCRIPT = str(ROOT / LESSON / "train.py")
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
# Two nodes of two processes, batch 16 each: the same run as lesson 02 with 4 ranks.
# What a rank waits for a peer when no --timeout is given. The tests below give a few seconds
# and check that the run stopped sooner than this: an order between two waits, which a busy
# machine, slow to start Python and torch (15 s at a load of 9 on 2 cores), does not upset.
DEFAULT_TIMEOUT = import_lesson(LESSON).parse_args([]).timeout
TWO_NODES = ["--nnodes", "2", "--nproc-per-node", "2", "--batch-size", "16", *CPU]


def by_hand(node_rank, out_dir, port, *extra):
    return [sys.executable, SCRIPT, *TWO_NODES, "--node-rank", str(node_rank),
            "--master-port", str(port), "--out-dir", str(out_dir), *extra]


def torchrun(out_dir, rendezvous, node_rank):
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", *rendezvous(node_rank), SCRIPT, "--batch-size", "16",
            *CPU, "--out-dir", str(out_dir)]


def assert_two_node_run(results, out_dirs):
    """Both nodes exit 0; node 0 alone prints and writes; every global rank appears once."""
    for node_rank, result in enumerate(results):
        assert result.returncode == 0, (node_rank, result.stdout, result.stderr)
    metrics = assert_good_run(results[0], out_dirs[0], world_size=4)
    assert (metrics["nnodes"], metrics["nproc_per_node"]) == (2, 2)
    assert "test accuracy:" not in results[1].stdout
    assert f"node 1 done: test accuracy {metrics['test_correct']}/36" in results[1].stdout
    assert not any(out_dirs[1].iterdir()), "node 1 wrote files; only global rank 0 may"
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in metrics["ranks"]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert evaluate_single_process(out_dirs[0]) == (metrics["test_correct"], 36)
    return metrics


@pytest.fixture(scope="module")
def lesson02_four_ranks(lesson_run):
    result, out_dir = lesson_run("02_multi_gpu_spawn", *CPU, "--world-size", 4,
                                 "--batch-size", 16)
    assert result.returncode == 0, result.stderr
    return out_dir


@pytest.fixture(scope="module")
def two_nodes_by_hand(tmp_path_factory):
    out_dirs = [tmp_path_factory.mktemp(f"node{n}") for n in (0, 1)]
    port = free_port()
    # 30 s, not the default 120: a node whose ranks find no peer (a wrong world size, node 0
    # already gone) stops within about twice that, and its test fails on the exit status, well
    # inside run_nodes' 240 s. Node 0 is up in a few seconds, 15 on a machine at load 9.
    results = run_nodes([(by_hand(n, out_dirs[n], port, "--timeout", "30"), {})
                         for n in (0, 1)])
    return results, out_dirs


def test_global_rank_gives_every_rank_exactly_once():
    lesson = import_lesson(LESSON)
    for nnodes in range(1, 5):
        for nproc in range(1, 5):
            ranks = [lesson.global_rank(node, nproc, local)
                     for node in range(nnodes) for local in range(nproc)]
            assert sorted(ranks) == list(range(nnodes * nproc)), (nnodes, nproc)
            # And back: the node is rank // nproc, the local rank rank % nproc.
            for rank in ranks:
                assert lesson.global_rank(rank // nproc, nproc, rank % nproc) == rank


def test_one_node_is_lesson_02(lesson_run):
    result, out_dir = lesson_run(LESSON, *CPU, "--nproc-per-node", 2, "--batch-size", 16)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["nnodes"], metrics["launcher"]) == (1, "spawn")
    _, lesson02 = lesson02_run(lesson_run, 2)
    assert max_weight_difference(out_dir, lesson02) == 0
    assert "rank 1 = 0 * 2 + 1" in result.stdout


def test_two_nodes_by_hand_equal_lesson02_with_four_ranks(two_nodes_by_hand,
                                                          lesson02_four_ranks):
    results, out_dirs = two_nodes_by_hand
    metrics = assert_two_node_run(results, out_dirs)
    assert metrics["launcher"] == "spawn"
    assert "node 1 of 2: starting 2 of 4 ranks" in results[1].stdout
    assert max_weight_difference(out_dirs[0], lesson02_four_ranks) < 1e-6


@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_nodes_with_torchrun_equal_the_run_by_hand(tmp_path, two_nodes_by_hand, form):
    port = free_port()
    rendezvous = {
        # --node-rank fixed per node, rank 0's address given: torchrun's "static" rendezvous.
        "static": lambda n: ["--node-rank", str(n), "--master-addr", "127.0.0.1",
                             "--master-port", str(port)],
        # One endpoint and a job id, the same on every node: torchrun numbers the nodes.
        "c10d": lambda n: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--rdzv-id", "test03"],
    }[form]
    out_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for out_dir in out_dirs:
        out_dir.mkdir()
    # With c10d the nodes' ranks are assigned at rendezvous, so the one that prints and writes
    # is whichever node got node rank 0: give both the same out dir and find it afterwards.
    if form == "c10d":
        out_dirs[1] = out_dirs[0]
    results = run_nodes([(torchrun(out_dirs[n], rendezvous, n), {}) for n in (0, 1)])
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    printed = [r for r in results if "test accuracy:" in r.stdout]
    assert len(printed) == 1, [r.stdout for r in results]
    metrics = assert_good_run(printed[0], out_dirs[0], world_size=4)
    assert (metrics["launcher"], metrics["nnodes"], metrics["nproc_per_node"]) == (
        "torchrun", 2, 2)
    assert sorted(r["rank"] for r in metrics["ranks"]) == [0, 1, 2, 3]
    assert max_weight_difference(out_dirs[0], two_nodes_by_hand[1][0]) < 1e-6


# --- two real hosts: network namespaces ------------------------------------------------------
def netns_unavailable():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return None


@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces, host A 10.214.N.1 and host B 10.214.N.2, joined by a veth pair.

    Each has its own loopback and one interface, called eth-ddp in both, so one
    GLOO_SOCKET_IFNAME fits both, as on a cluster whose nodes name their interfaces alike."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.214.{os.getpid() % 250}"
    hosts = [f"ddp-test-{tag}-a", f"ddp-test-{tag}-b"]
    veth = [f"ddpa{tag}", f"ddpb{tag}"]
    commands = [
        ["ip", "netns", "add", hosts[0]], ["ip", "netns", "add", hosts[1]],
        ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
    ]
    for host, link, address in zip(hosts, veth, (f"{subnet}.1", f"{subnet}.2"), strict=True):
        commands += [
            ["ip", "link", "set", link, "netns", host],
            ["ip", "-n", host, "link", "set", link, "name", "eth-ddp"],
            ["ip", "-n", host, "addr", "add", f"{address}/24", "dev", "eth-ddp"],
            ["ip", "-n", host, "link", "set", "eth-ddp", "up"],
            ["ip", "-n", host, "link", "set", "lo", "up"],
        ]
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"network namespaces unusable here: {' '.join(command)}: "
                            f"{done.stderr.strip()}")
        yield {"hosts": hosts, "addresses": [f"{subnet}.1", f"{subnet}.2"], "subnet": subnet}
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "delete", host], capture_output=True)


def on_host(two_hosts, index, argv):
    return ["ip", "netns", "exec", two_hosts["hosts"][index], *argv]


def test_two_hosts_train_together(two_hosts, tmp_path, two_nodes_by_hand):
    master = two_hosts["addresses"][0]
    out_dirs = [tmp_path / "a", tmp_path / "b"]
    for out_dir in out_dirs:
        out_dir.mkdir()
    env = {"GLOO_SOCKET_IFNAME": "eth-ddp"}
    results = run_nodes([
        (on_host(two_hosts, n, by_hand(n, out_dirs[n], 29500, "--master-addr", master)), env)
        for n in (0, 1)])
    assert_two_node_run(results, out_dirs)
    assert f"rank 0 listens on {master}:29500" in results[1].stdout
    # Host B cannot reach host A's loopback: the job really went over the veth pair.
    assert max_weight_difference(out_dirs[0], two_nodes_by_hand[1][0]) < 1e-6


def test_unreachable_master_fails_within_the_timeout(two_hosts, tmp_path):
    # Nobody has the address .3 on the link: connections go unanswered.
    absent = f"{two_hosts['subnet']}.3"
    start = time.monotonic()
    result = subprocess.run(
        on_host(two_hosts, 1, by_hand(1, tmp_path, 29500, "--master-addr", absent,
                                      "--timeout", "3")),
        env={**os.environ, "GLOO_SOCKET_IFNAME": "eth-ddp"}, capture_output=True, text=True,
        timeout=2 * DEFAULT_TIMEOUT)
    elapsed = time.monotonic() - start
    assert_one_line_error(result, f"nothing answered at {absent}:29500 within 3 s",
                          "--master-addr", "--timeout")
    assert elapsed < DEFAULT_TIMEOUT, elapsed


def test_gloo_on_a_loopback_hostname_is_refused_before_it_hangs(two_hosts, tmp_path):
    # These hosts' name resolves to 127.0.0.1 (or no address): without GLOO_SOCKET_IFNAME gloo
    # would listen on loopback, where the other host cannot connect.
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    hostname = socket.gethostname()
    try:
        resolves_to_loopback = socket.gethostbyname(hostname).startswith("127.")
    except OSError:
        resolves_to_loopback = True
    if not resolves_to_loopback:
        pytest.skip(f"this machine's name {hostname} resolves to a routable address")
    result = subprocess.run(
        on_host(two_hosts, 1, by_hand(1, tmp_path, 29500, "--master-addr",
                                      two_hosts["addresses"][0])),
        env=env, capture_output=True, text=True, timeout=60)
    assert_one_line_error(result, "GLOO_SOCKET_IFNAME", f"ip route get {two_hosts['addresses'][0]}")


# --- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--nnodes", 2, "--node-rank", 2], ["--node-rank 2 is out of range for --nnodes 2",
                                             "0 .. 1"]),
        (["--nnodes", 0], ["--nnodes must be at least 1"]),
        (["--nproc-per-node", -1], ["--nproc-per-node must be at least 1"]),
        (["--node-rank", -1], ["--node-rank must be 0 or more"]),
        (["--timeout", 0], ["--timeout must be positive"]),
        (["--master-port", 70000], ["--master-port must be a port number"]),
        (["--nnodes", 2, "--master-addr", "192.0.2.1"],
         ["192.0.2.1 is not an address of this machine", "node 0"]),
    ],
)
def test_bad_input_gets_one_clear_line(tmp_path, args, fragments):
    assert_one_line_error(run_lesson(LESSON, *CPU, *args, "--out-dir", tmp_path), *fragments)


def test_master_nobody_listens_on_fails_within_the_timeout(tmp_path):
    start = time.monotonic()
    result = run_lesson(LESSON, *CPU, "--nnodes", 2, "--node-rank", 1, "--nproc-per-node", 2,
                        "--master-port", free_port(), "--timeout", 2, "--out-dir", tmp_path)
    assert_one_line_error(result, "nothing answered at 127.0.0.1", "within 2 s",
                          "start node 0 first")
    assert time.monotonic() - start < DEFAULT_TIMEOUT
    assert not any(tmp_path.iterdir())


def test_node_0_alone_stops_after_the_timeout(tmp_path):
    # --nnodes 2 but node 1 never comes: rank 0 gives up after --timeout, with the fix.
    start = time.monotonic()
    result = run_lesson(LESSON, *CPU, "--nnodes", 2, "--nproc-per-node", 1, "--master-port",
                        free_port(), "--timeout", 3, "--out-dir", tmp_path)
    assert_one_line_error(result, "not all 2 ranks met", "within 3 s",
                          "same --nnodes, --nproc-per-node, --master-addr and --master-port")
    assert time.monotonic() - start < DEFAULT_TIMEOUT


def test_nodes_started_with_different_flags_stop_with_the_reason(tmp_path):
    port = free_port()
    results = run_nodes([
        (by_hand(0, tmp_path, port, "--epochs", "3"), {}),
        (by_hand(1, tmp_path, port, "--epochs", "5"), {}),
    ], timeout=120)
    for result in results:
        assert result.returncode != 0
        assert "node 1 was started with --epochs 5 but node 0 with --epochs 3" in result.stderr
        assert "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


def test_manual_flags_under_torchrun_are_refused(tmp_path):
    result = run_torchrun(LESSON, *CPU, "--nnodes", 2, "--out-dir", tmp_path, nproc=1,
                          timeout=120)
    assert result.returncode != 0
    assert "give --nnodes, --node-rank, --nproc-per-node, --master-addr and --master-port to " \
           "torchrun" in result.stderr


def test_a_node_that_goes_away_is_named_in_one_line(tmp_path):
    # Node 1 is killed mid-training (a machine that crashed or lost its network). Node 0 ends
    # promptly with one line that says a peer node went away and whose log to read.
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, SCRIPT, *CPU, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
         str(node_rank), "--master-port", str(port), "--epochs", "100000", "--out-dir",
         str(tmp_path / f"node{node_rank}")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for node_rank in (0, 1)]
    try:
        for line in nodes[0].stdout:
            if line.startswith("epoch   2/"):
                break
        os.killpg(nodes[1].pid, signal.SIGKILL)
        start = time.monotonic()
        out, err = nodes[0].communicate(timeout=2 * DEFAULT_TIMEOUT)
        took = time.monotonic() - start
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.communicate()
    result = subprocess.CompletedProcess(nodes[0].args, nodes[0].returncode, out, err)
    line = assert_one_line_error(result, "lost contact with the other ranks",
                                 "a peer node went away", "the log of node 1")
    assert line.startswith("error: rank 0 ")
    assert took < DEFAULT_TIMEOUT  # it saw the lost connection, not its own --timeout run out
