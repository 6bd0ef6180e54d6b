"""TROUBLESHOOTING.md's demos, run as a learner runs them: each shows its symptom, then its fix.

Every demo bounds its waits with a timeout of a few seconds, so a demo that hung would fail here
on the subprocess timeout instead of stalling the suite."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import GPUS, ROOT

DEMOS = sorted(p.name for p in (ROOT / "troubleshooting").glob("*.py"))


def run_demo(name):
    result = subprocess.run([sys.executable, str(ROOT / "troubleshooting" / name)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def assert_both_ranks_gave_up(out):
    """Each rank waited for the other and gave up: at least one on its own 2-second timeout;
    the other may instead see the connection its peer closed on giving up."""
    gave_up = re.findall(r"rank ([01]) gave up after \d+ s: (.*)", out)
    assert sorted(rank for rank, _ in gave_up) == ["0", "1"], out
    assert any("Timed out waiting 2000ms" in error for _, error in gave_up), out


def test_the_guide_and_the_demos_name_each_other():
    # A demo the guide does not mention is never found; a command in the guide without its demo
    # is a broken promise. Both directions, no exceptions.
    for guide in (ROOT / "TROUBLESHOOTING.md", ROOT / "troubleshooting" / "README.md"):
        commands = set(re.findall(r"python troubleshooting/(\w+\.py)", guide.read_text()))
        assert commands == set(DEMOS), guide.name
    tested = set(re.findall(r'run_demo\("(\w+\.py)"\)', Path(__file__).read_text()))
    assert tested == set(DEMOS)


def test_hang_at_start_up_and_at_a_collective():
    out = run_demo("hang.py")
    # A rank that never comes: init_process_group gives up after the timeout, with torch's words.
    assert "1/2 clients joined" in out
    assert "symptom: rank 0 waits at init_process_group for a rank that never comes" in out
    assert "fix: with every rank started (here by mp.spawn), the group forms" in out
    # A collective only rank 0 calls: both ranks give up, each waiting for the other.
    assert_both_ranks_gave_up(out)
    # DETAIL names the mismatch at once instead of waiting.
    assert "Detected mismatch between collectives on ranks" in out
    assert "OpType=ALLREDUCE" in out
    assert "fix: all_reduce on every rank, then the barrier: done, sum = 3" in out


def test_port_in_use():
    out = run_demo("port_in_use.py")
    assert "The server socket has failed to listen on any local network address" in out
    if sys.platform == "linux":
        assert "EADDRINUSE" in out
    assert re.search(r"symptom: port \d+ is already in use", out)
    assert re.search(r"fix: a free port from the operating system \(\d+\): the group started", out)


def test_missing_set_epoch_repeats_the_order():
    out = run_demo("missing_set_epoch.py")
    orders = re.findall(r"epoch \d: rank 0 gets (\[.*\])", out)
    assert len(orders) == 6
    without, fixed = orders[:3], orders[3:]
    assert len(set(without)) == 1  # the symptom: one order, three times
    assert len(set(fixed)) == 3  # the fix: a new order every epoch
    assert without[0] == fixed[0]  # epoch 0 is the same either way: seed + 0
    assert "symptom: rank 0 gets the same samples in the same order in all 3 epochs" in out
    assert "fix: 3 different orders" in out


def test_sampler_padding_counts_samples_twice():
    out = run_demo("sampler_padding.py")
    assert re.search(r"one process \(the truth\)\s+32/36", out)
    assert re.search(r"DistributedSampler \(pads with repeats\)\s+34/40", out)
    assert "symptom: 40 samples counted for a test set of 36: 4 were counted twice" in out
    assert re.search(r"test_set\[rank::world_size\]\s+32/36", out)
    assert "fix: the stride counts each of the 36 samples exactly once" in out


def test_weights_only_refuses_a_namespace():
    out = run_demo("weights_only.py")
    assert "Weights only load failed" in out
    assert "Unsupported global: GLOBAL argparse.Namespace" in out
    assert "fix 1: saved vars(args) instead; weights_only=True loads it" in out
    assert "fix 2: safe_globals([argparse.Namespace]) loads the old file" in out


def test_map_location():
    out = run_demo("map_location.py")
    if GPUS == 0:
        assert "Attempting to deserialize object on a CUDA device" in out
    elif GPUS == 1:
        assert "Attempting to deserialize object on CUDA device 1" in out
    else:
        assert "symptom: torch.load without map_location put the weights on cuda:1" in out
    assert "fix: torch.load(path, map_location='cpu') put them on cpu" in out


def test_uneven_inputs_hang_and_join():
    out = run_demo("uneven_inputs.py")
    assert_both_ranks_gave_up(out)
    assert "symptom: rank 0 waits in its step 3 gradient all-reduce" in out
    assert "fix: under Join both ranks finish (3 and 2 steps) with the same weights" in out


def test_spawn_from_a_notebook():
    out = run_demo("notebook_spawn.py")
    # Python's own words, which differ between versions after the first few: match those.
    assert "AttributeError: Can't get attribute 'worker'" in out
    assert "symptom: the new processes cannot find worker" in out
    assert "ProcessExitedException" in out
    assert "hello from rank 0; hello from rank 1" in out
    assert "fix: both ranks ran" in out


@pytest.mark.skipif(sys.platform == "win32", reason="no interface named lo or lo0 on Windows")
def test_gloo_interface_name():
    out = run_demo("socket_ifname.py")
    assert "Unable to find address for: ^lo" in out
    assert "symptom: gloo takes one interface name" in out
    assert re.search(r"fix: GLOO_SOCKET_IFNAME=lo0?, an interface of this machine: the group "
                     r"started", out)


def test_unused_parameters_stop_the_second_step():
    out = run_demo("unused_parameters.py")
    assert "RuntimeError: Expected to have finished reduction in the prior iteration" in out
    assert "Parameter indices which did not receive grad for rank 0: 4 5" in out
    assert "symptom: the second step stops at once; parameters aux.weight, aux.bias got no " \
        "gradient" in out
    for option in ("find_unused_parameters=True", "static_graph=True"):
        assert f"fix: DDP(model, {option}): 3 steps, the same weights on both ranks: True" in out


def test_batchnorm_statistics_differ_between_ranks():
    out = run_demo("batchnorm_stats.py")
    # Rank 0's data lie around 0, rank 1's around 4: on their own, the running means follow
    # each rank's data; by default rank 0's buffers win; neither is the mean of all the data.
    truth = float(re.search(r"the mean of all ranks' data: ([\d.]+)", out).group(1))
    separate = re.search(r"forward_sync_buffers=False: \[([-\d.]+), ([-\d.]+)\]", out).groups()
    assert abs(float(separate[0])) < 0.5 and abs(float(separate[1]) - 4) < 0.5
    default = re.search(r"rank 0's buffers broadcast\): \[([-\d.]+), ([-\d.]+)\]", out).groups()
    assert all(abs(float(value) - truth) > 1 for value in default)
    assert "symptom: each rank normalises with its own batch's statistics" in out
    if GPUS >= 2:
        assert "fix: SyncBatchNorm gives every rank the statistics of the global batch: True" in out
    else:
        # SyncBatchNorm refuses CPU modules, with torch's words; the demo says it needs GPUs.
        assert "SyncBatchNorm on cpu: ValueError: SyncBatchNorm layers only work with GPU" in out
        assert "it runs only on GPUs, so it cannot run on this machine" in out


def test_slow_rank_zero_times_out_the_others():
    out = run_demo("slow_rank_zero.py")
    # Rank 1 gives up on its own 2-second timeout while rank 0 evaluates for 3 s: in the next
    # all_reduce, and with a barrier after the evaluation, in the barrier instead.
    for collective in ("all_reduce", "barrier"):
        assert re.search(rf"rank 1 gave up after 2 s \({collective}\): .*Timed out waiting 2000ms",
                         out), out
    assert "symptom: rank 0 evaluates for 3 s; rank 1 waits for it in the next all_reduce" in out
    assert "symptom: with a barrier after the evaluation, rank 1 times out in the barrier" in out
    # Both fixes run the same evaluation and nobody gives up: split between the ranks, under
    # the same timeout; and alone on rank 0, under a timeout longer than the evaluation. The
    # demo's margins are wall-clock (fix 1: 0.5 s, fix 2: 2 s), which hold on a machine running
    # the suite's two workers and nothing else.
    assert out.count("gave up") == 4, out
    assert re.search(r"fix 1: each rank evaluates half \(1\.5 s\), then all_reduce: they waited "
                     r"[01]\.\d and [01]\.\d s, within the same 2 s timeout", out), out
    assert re.search(r"fix 2: with timeout=5 s, rank 1 waits \d\.\d s in all_reduce", out), out


def test_early_stopping_on_one_rank_hangs_the_other():
    out = run_demo("early_stopping.py")
    # Rank 0's own loss gets worse after epoch 3, rank 1's does not: rank 0 leaves the loop and
    # both wait for each other until the timeout.
    assert "rank 0 stopped early after epoch 3" in out
    assert "rank 1 stopped early" not in out
    assert_both_ranks_gave_up(out)
    assert "symptom: rank 0 stops after epoch 3 and waits in barrier" in out
    # Agreed decisions: the same number of epochs on both ranks.
    assert "fix: deciding on the stop flag all-reduced with MAX: the ranks trained 3 and 3" in out
    assert "fix: deciding on the mean validation loss of both halves: the ranks trained 4 and 4" \
        in out


def test_every_rank_downloading_reads_a_half_written_file():
    out = run_demo("download_once.py")
    # Rank 1 finds the file rank 0 is still writing, skips the download and reads half of it:
    # torch.load fails on the truncated archive (torch 2.14 raises OSError; any error will do).
    assert re.search(r"rank 1 read the file at \d+ bytes and torch\.load raised \w+", out), out
    assert "rank 1 read 1000 samples" not in out
    assert "rank 0 read 1000 samples" in out  # the rank that wrote it reads it whole
    assert "symptom: rank 1 found the file that rank 0 was still writing (10 of 20 chunks)" in out
    # Rank 0 alone downloads, to a temporary name; rank 1 waits at the barrier; both read it all.
    assert re.search(r"rank 1: 1000 samples, after \d+\.\d s waiting at dist\.barrier\(\)", out)
    assert "fix: rank 0 downloaded to once.pt.tmp and renamed it; rank 1 waited at the barrier; " \
        "both read the same 1000 samples" in out
