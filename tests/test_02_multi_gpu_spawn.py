"""Lesson 02, run as a learner runs it: python 02_multi_gpu_spawn/train.py (mp.spawn, gloo/CPU).

The GPU tier (NCCL) is in test_gpu.py."""

import math
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from helpers import (
    LESSON02_RUNS,
    NO_GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    error_lines,
    evaluate_single_process,
    free_port,
    import_guard_rails,
    import_lesson,
    interrupt_when,
    lesson02_run,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
)

LESSON = "02_multi_gpu_spawn"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two learners on one machine, started at the same moment; one launch serves the tests of
    both. Job 0 is the README's quick start: no arguments, from a fresh folder, with the GPUs
    hidden, which is the CPU machine's default on any machine (test_gpu.py runs the same command
    with the GPUs visible); it finds a free port of its own. Job 1 is told its port through
    MASTER_PORT, which wins over the free port it would have picked."""
    cwd = tmp_path_factory.mktemp("lesson02_default")
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    own_port = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    script = str(ROOT / LESSON / "train.py")
    told = tmp_path_factory.mktemp("lesson02_told_its_port")
    jobs = [subprocess.Popen([sys.executable, script], cwd=cwd, env={**own_port, **NO_GPUS},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            subprocess.Popen([sys.executable, script, *CPU, "--world-size", "2", "--epochs", "2",
                              "--out-dir", told], env={**own_port, "MASTER_PORT": str(port)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    outputs = [job.communicate(timeout=240) for job in jobs]
    results = [subprocess.CompletedProcess(job.args, job.returncode, out, err)
               for job, (out, err) in zip(jobs, outputs, strict=True)]
    return results, [cwd / "runs" / LESSON, told], port


@pytest.fixture(scope="module")
def default_run(two_jobs):
    results, out_dirs, _ = two_jobs
    return results[0], out_dirs[0]


def test_default_run_is_two_cpu_ranks_and_learns(default_run):
    result, out_dir = default_run
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("gloo", "cpu")
    # Each rank gets its share of the cores, not all of them.
    assert metrics["threads_per_rank"] == max(1, len(os.sched_getaffinity(0)) // 2)


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_world_sizes_train_to_the_same_quality(lesson_run, world_size):
    result, out_dir = lesson02_run(lesson_run, world_size)
    metrics = assert_good_run(result, out_dir, world_size=world_size)
    assert metrics["threads_per_rank"] >= 1


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_evaluation_counts_each_test_wine_exactly_once(lesson_run, world_size):
    # 36 test wines over 5 ranks do not split evenly (8, 7, 7, 7, 7); DistributedSampler would
    # pad them to 40, and count 4 of them twice.
    result, out_dir = lesson02_run(lesson_run, world_size)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(out_dir)
    assert metrics["test_total"] == 36
    # The distributed count equals one process evaluating the same weights.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


def test_ddp_with_two_ranks_equals_one_process_with_twice_the_batch(lesson_run):
    _, one = lesson02_run(lesson_run, 1)  # batch 32
    _, two = lesson02_run(lesson_run, 2)  # 2 x batch 16
    assert read_metrics(two)["test_total"] == 36
    assert max_weight_difference(one, two) < 1e-5


def test_the_printed_loss_is_the_mean_over_every_rank(lesson_run):
    # At every step the two ranks' 16 wines are the 32 that one process sees, and their weights
    # are its weights: the all-reduced mean over both ranks' samples is that process's loss,
    # epoch by epoch. Rank 0's own half is another number (the all-reduce left out, this fails).
    one = read_metrics(lesson02_run(lesson_run, 1)[1])["train_loss"]
    two = read_metrics(lesson02_run(lesson_run, 2)[1])["train_loss"]
    assert two == pytest.approx(one, rel=1e-5, abs=0)


def test_control_without_gradient_averaging_gives_other_weights(lesson_run):
    # Same run with DDP swapped for a wrapper that does not all-reduce gradients: each rank
    # trains alone on half the data, and the comparison above must fail.
    _, one = lesson02_run(lesson_run, 1)
    result, alone = lesson_run(LESSON, *CPU, "--world-size", 2, *LESSON02_RUNS[2], patch="no-ddp")
    assert result.returncode == 0, result.stderr
    assert max_weight_difference(one, alone) > 1e-2


def test_sampler_deals_disjoint_slices_that_cover_the_data():
    lesson = import_lesson(LESSON)
    train_set, _ = lesson.load_data()
    n = len(train_set)
    for world_size in (1, 2, 3, 5):
        samplers = [lesson.prepare_dataloader(train_set, 16, 0, rank, world_size).sampler
                    for rank in range(world_size)]
        for epoch in (0, 1):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            shards = [list(sampler) for sampler in samplers]
            dealt = [i for shard in shards for i in shard]
            assert set(dealt) == set(range(n))  # every sample is dealt
            assert len({len(shard) for shard in shards}) == 1  # the same count on every rank
            # Repeats only to pad the data to a multiple of world_size; none when it divides.
            assert len(dealt) - n == world_size * math.ceil(n / world_size) - n


def test_set_epoch_changes_the_order():
    lesson = import_lesson(LESSON)
    train_set, _ = lesson.load_data()
    sampler = lesson.prepare_dataloader(train_set, 16, 0, 0, 2).sampler
    orders = []
    for epoch in (0, 1, 0):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] != orders[1]  # a new order each epoch
    assert orders[0] == orders[2]  # and a reproducible one


def test_trainer_calls_set_epoch_every_epoch(tmp_path):
    # In-process with a group of one rank: the Trainer must reseed the sampler each epoch.
    lesson = import_lesson(LESSON)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        train_set, test_set = lesson.load_data()
        loader = lesson.prepare_dataloader(train_set, 32, 0, 0, 1)
        calls = []
        loader.sampler.set_epoch = lambda epoch: (
            calls.append(epoch), DistributedSampler.set_epoch(loader.sampler, epoch))
        model = lesson.DDP(lesson.WineMLP())
        optimizer = torch.optim.Adam(model.parameters())
        trainer = lesson.Trainer(model, loader, test_set, optimizer, torch.device("cpu"),
                                 100, str(tmp_path))
        for epoch in range(3):
            trainer.train_epoch(epoch)
        assert calls == [0, 1, 2]
    finally:
        dist.destroy_process_group()


# The README's three init_methods, each on 2 forked gloo ranks that all-reduce their rank + 1.
MEET = """
import datetime, multiprocessing, os, sys
import torch
import torch.distributed as dist


def rank(r, url):
    dist.init_process_group("gloo", init_method=url, rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    total = torch.tensor([r + 1.0])
    dist.all_reduce(total)
    os.write(1, f"{url.split(':')[0]} {r} {int(total.item())}\\n".encode())  # one line at once
    dist.destroy_process_group()


port, path = sys.argv[1], sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
for url in ("env://", f"tcp://127.0.0.1:{port}", f"file://{path}"):
    ranks = [multiprocessing.get_context("fork").Process(target=rank, args=(r, url))
             for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(90)
    print(url.split(":")[0], "exit codes", [p.exitcode for p in ranks], flush=True)
print("file left behind:", os.path.exists(path))
"""


def test_the_ranks_meet_through_env_tcp_and_file(tmp_path):
    path = tmp_path / "meet"
    result = subprocess.run([sys.executable, "-c", MEET, str(free_port()), str(path)],
                            capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    for method in ("env", "tcp", "file"):
        assert f"{method} exit codes [0, 0]" in result.stdout, output
        assert sorted(re.findall(rf"^{method} \d \d+$", result.stdout, re.M)) == [
            f"{method} 0 3", f"{method} 1 3"], output
    # file://'s FileStore: torch removes the file once every rank has left.
    assert "file left behind: False" in result.stdout, output


def test_master_port_in_use_gets_one_clear_line(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_lesson(LESSON, *CPU, "--world-size", 2, "--out-dir", tmp_path,
                            env={"MASTER_PORT": str(port)})
    assert_one_line_error(result, f"MASTER_PORT={port} is already in use", "unset it")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--save-every", "0"], "--save-every must be at least 1"),
    ],
)
def test_bad_input_gets_one_clear_line(args, fragment, tmp_path):
    assert_one_line_error(run_lesson(LESSON, *args, "--out-dir", tmp_path), fragment)


def test_nccl_without_gpus_is_refused(tmp_path):
    # The GPUs, if any, hidden: what a machine without one sees.
    result = run_lesson(LESSON, "--backend", "nccl", "--out-dir", tmp_path, env=NO_GPUS)
    assert_one_line_error(result, "--backend nccl needs CUDA GPUs", "--backend gloo")


@pytest.mark.skipif(sys.platform != "linux",
                    reason="start_ranks forks from a server on Linux only; here it spawns")
def test_the_ranks_are_forked_from_a_server_that_imported_torch_once(tmp_path):
    # -X importtime logs every module a process imports, and multiprocessing passes the option on
    # to the processes it starts. With spawn, torch is imported by the launcher and again by each
    # of the 3 ranks, scikit-learn and torch._dynamo (DDP's) by each rank; forked from the
    # server, every one of them once more in the server alone, and never in a rank.
    mark = f"course-test-{os.getpid()}-{tmp_path.name}"
    with open(tmp_path / "stdout", "w+") as out, open(tmp_path / "stderr", "w+") as err:
        launcher = subprocess.Popen([sys.executable, "-X", "importtime",
                                     str(ROOT / LESSON / "train.py"), *CPU, "--world-size", "3",
                                     "--epochs", "1", "--out-dir", tmp_path / "run"],
                                    stdout=out, stderr=err, text=True,
                                    env={**os.environ, "COURSE_TEST_MARK": mark})
        # The launcher has exited: its fork server is gone too (guard_rails.leave_quickly), not
        # still tearing its torch down for a second or more, with the launcher's output open.
        launcher.wait(timeout=240)
        deadline = time.monotonic() + 0.5
        while (servers := fork_servers_marked(mark)) and time.monotonic() < deadline:
            time.sleep(0.05)
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert launcher.returncode == 0, stderr[-3000:]
    assert not servers, "the fork server outlived the launcher"
    imported = re.findall(r"^import time:.*\|\s*(torch|sklearn|torch\._dynamo)$", stderr,
                          re.MULTILINE)
    assert {name: imported.count(name) for name in set(imported)} == {
        "torch": 2, "sklearn": 1, "torch._dynamo": 1}
    assert "test accuracy:" in stdout


def fork_servers_marked(mark):
    """The live fork servers (not zombies) whose environment holds COURSE_TEST_MARK=mark."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline, \
                    open(f"/proc/{pid}/environ", "rb") as environ:
                if b"multiprocessing.forkserver" in cmdline.read() and \
                        f"COURSE_TEST_MARK={mark}".encode() in environ.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def test_a_long_tmpdir_still_starts_the_ranks(tmp_path):
    # The fork server's socket lives under $TMPDIR; a path over 107 bytes cannot be a socket's
    # (tools/repro_forkserver_tmpdir.py), so spawn_guard puts it under /tmp.
    long_tmpdir = tmp_path / ("x" * (90 - len(str(tmp_path)) - 1))
    long_tmpdir.mkdir()
    result = run_lesson(LESSON, *CPU, "--world-size", 2, "--epochs", 1, "--out-dir",
                        tmp_path / "out", env={**os.environ, "TMPDIR": str(long_tmpdir)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "test accuracy:" in result.stdout


def test_a_rank_that_raises_takes_the_job_down_and_is_named(lesson_run):
    # Rank 1 raises while rank 0 waits for it in the gradient all-reduce. The job must end
    # (no hang: the run's timeout would fail this test) and say which rank failed and why.
    result, _ = lesson_run(LESSON, *CPU, "--world-size", 2, patch="raise-on-rank-1")
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: rank 1 failed")


def test_two_jobs_started_at_the_same_moment_both_succeed(two_jobs):
    (default, told), out_dirs, port = two_jobs
    for job, out_dir in zip((default, told), out_dirs, strict=True):
        assert job.returncode == 0, job.stderr
        assert read_metrics(out_dir)["test_total"] == 36
    assert f"rank 0 listens on 127.0.0.1:{port}" in told.stdout
    assert "rank 0 listens on 127.0.0.1:" in default.stdout
    assert f"127.0.0.1:{port}" not in default.stdout


def test_out_dir_that_is_a_file_gets_one_clear_line(tmp_path):
    path = tmp_path / "results"
    path.write_text("a file where the results folder should go\n")
    result = run_lesson(LESSON, *CPU, "--out-dir", path)
    assert_one_line_error(result, f"--out-dir {path} is a file", "choose another --out-dir")
    assert "starting" not in result.stdout  # refused before any rank started


def test_torchrun_is_named_as_the_wrong_launcher_not_the_port(tmp_path):
    # This lesson starts its own ranks with mp.spawn; under torchrun it used to blame the port.
    result = run_torchrun(LESSON, *CPU, "--out-dir", tmp_path, nproc=2)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert "is not written for torchrun" in errors[0]
    assert "start it with: python " in errors[0] and "02_multi_gpu_spawn/train.py" in errors[0]
    assert "already in use" not in result.stderr
    assert not (tmp_path / "metrics.json").exists()


def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    # Ctrl-C in a terminal sends SIGINT to the launcher and to its ranks at once.
    result, took, left = interrupt_when(
        [sys.executable, str(ROOT / LESSON / "train.py"), *CPU, "--world-size", "2",
         "--epochs", "100000", "--out-dir", str(tmp_path)], marker="epoch")
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "interrupted (Ctrl-C)" in errors[0], result.stderr
    # A wall-clock bound: the ranks stop within seconds. 30 s holds on a machine running the
    # suite's two workers and nothing else; a run that ignored Ctrl-C would go on for hours.
    assert took < 30
    assert not left, f"processes left behind: {left}"


def test_ctrl_c_reaches_the_command_even_from_a_test_run_in_the_background(tmp_path):
    # pytest started in the background by a script ignores SIGINT, and its children inherit
    # that. interrupt_when puts SIGINT back to its default, as a terminal gives it: with
    # AS_FROM_A_TERMINAL's signal.signal call taken out, the sleeper below ignores Ctrl-C and
    # this test fails (-9, no KeyboardInterrupt).
    script = tmp_path / "press.py"
    script.write_text(
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from helpers import interrupt_when\n"
        "sleeper = [sys.executable, '-c', 'import time; print(\"ready\", flush=True); "
        "time.sleep(90)']\n"
        "result, took, left = interrupt_when(sleeper, marker='ready', timeout=60)\n"
        "print(result.returncode, 'KeyboardInterrupt' in result.stderr, left)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    # An uncaught KeyboardInterrupt ends Python by SIGINT itself: exit status -2.
    assert done.stdout.split() == ["-2", "True", "[]"], done.stdout + done.stderr


def test_a_stalled_rank_ends_the_job_within_the_timeout(lesson_run):
    # Rank 1 sleeps for 5 minutes in its second epoch; rank 0 waits for it in the all-reduce
    # only as long as --timeout, then the job ends with one line. What ended the wait is named
    # in it: gloo's 5000 ms, --timeout 5 (not gloo's own 30 minutes). No clock is read: a run
    # that waited for the sleeper would pass run_lesson's 240 s limit and fail the test.
    result, _ = lesson_run(LESSON, *CPU, "--world-size", 2, "--epochs", 3, "--timeout", 5,
                           patch="stall-rank-1")
    line = assert_one_line_error(result, "rank 0 lost contact with the other ranks",
                                 "stalled longer than --timeout")
    assert "Timed out waiting 5000ms" in line, line


def test_a_rank_aborted_as_by_nccls_watchdog_is_told_as_a_timeout_not_memory(tmp_path):
    # With NCCL, a collective that waits longer than --timeout ends its rank with SIGABRT (the
    # watchdog); no Python exception is raised. Shown on gloo by aborting rank 1 the same way.
    result = run_lesson(LESSON, *CPU, "--world-size", 2, "--epochs", 2, "--out-dir", tmp_path,
                        patch="abort-rank-1")
    line = assert_one_line_error(result, "rank 1 was aborted (SIGABRT)", "longer than --timeout",
                                 "the other ranks were stopped")
    assert "memory" not in line


def test_leaving_the_group_after_a_failure_aborts_nccl_and_destroys_gloo(monkeypatch):
    # destroy_process_group would wait for NCCL collectives that lost peers never join; an
    # abort does not. gloo's destroy does not wait, and stays the way out.
    guard_rails = import_guard_rails()
    calls = []
    monkeypatch.setattr(guard_rails.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(guard_rails.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(guard_rails.dist.distributed_c10d, "_abort_process_group",
                        lambda: calls.append("abort"))
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(guard_rails.dist, "get_backend", lambda backend=backend: backend)
        for failed in (False, True):
            guard_rails.leave_group(failed)
    assert calls == ["destroy", "abort", "destroy", "destroy"]


def test_timeout_must_be_positive(tmp_path):
    assert_one_line_error(run_lesson(LESSON, "--timeout", 0, "--out-dir", tmp_path),
                          "--timeout must be positive")


def test_only_errors_about_the_other_ranks_are_called_lost_contact():
    # rank_guard turns these into "not all ranks met" / "lost contact" lines. Any other backend
    # error is the rank's own, and a line that blamed the peers or --timeout would send the
    # learner the wrong way: NCCL's duplicate-GPU refusal is one (two ranks on one GPU).
    is_lost_contact = import_guard_rails().is_lost_contact
    peers_gone = [
        dist.DistStoreError("wait timeout after 120000ms"),
        dist.DistNetworkError("failed to connect"),
        RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:4"),
        dist.DistBackendError("NCCL error: remote process exited or there was a network error"),
        RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms"),
    ]
    own_fault = [
        dist.DistBackendError("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0"),
        dist.DistBackendError("Tensor found on device cuda:1 but backend constrained to cuda:0"),
        ValueError("connection reset by peer"),  # not from torch.distributed's collectives
    ]
    assert [is_lost_contact(error) for error in peers_gone] == [True] * len(peers_gone)
    assert [is_lost_contact(error) for error in own_fault] == [False] * len(own_fault)
