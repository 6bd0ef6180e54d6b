"""What the tests share: running a lesson the way a learner does and reading what it wrote."""

import atexit
import contextlib
import importlib.util
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import sklearn  # noqa: F401 - it sets KMP_* in os.environ on import, as in every lesson's process:
import torch  # set here, before a lesson runner copies the environment (LessonRunner)
from lesson_runner import SHARED_STARTS  # the lessons whose plain runs share one Python

ROOT = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count()
# The environment of a machine without GPUs: with CUDA_VISIBLE_DEVICES empty, torch sees none,
# so a lesson run with it takes its CPU defaults (2 gloo ranks) on any machine, GPUs or not.
NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


# Lesson 02's runs that its own tests and lessons 03, 05 and 07 look at: one process with batch
# 32 and two ranks with batch 16, the same global batch and so the same steps; 5 ranks with batch
# 8, more ranks than a 2-core machine has cores, over which the 36 test wines do not split evenly.
LESSON02_RUNS = {1: ["--batch-size", 32], 2: ["--batch-size", 16], 5: ["--batch-size", 8]}


def lesson02_run(lesson_run, world_size):
    """One of LESSON02_RUNS on gloo; lesson_run makes it once per session."""
    return lesson_run("02_multi_gpu_spawn", "--backend", "gloo", "--world-size", world_size,
                      *LESSON02_RUNS[world_size])


def run_lesson(lesson, *args, cwd=None, env=None, timeout=240, patch=None, fresh=False):
    """Run `python <lesson>/train.py args...` as a subprocess and return the finished process.

    With patch, the lesson runs under tests/patched_lesson.py with that patch applied. A plain
    run of a lesson that forks its ranks (no patch, env or cwd of its own, fresh False) goes to
    the lesson's runner (tests/lesson_runner.py): the same script, exit status and output, from
    a Python that has imported torch and started the fork server once for all such runs. So
    does a run whose env hides the GPUs and sets nothing else (NO_GPUS), to a runner of its own
    started in that environment."""
    script = str(ROOT / lesson / "train.py")
    command = [sys.executable, script, *map(str, args)]
    if lesson in SHARED_STARTS and not (patch or cwd or fresh) and set(env or {}) <= {
            "CUDA_VISIBLE_DEVICES"}:
        return LessonRunner.for_lesson(script, env or {}).run(command, timeout)
    if patch:
        command = [sys.executable, str(ROOT / "tests" / "patched_lesson.py"), script, patch,
                   *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd or ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)



class LessonRunner:
    """One tests/lesson_runner.py process: the plain runs of one lesson, one after another.

    Each of this Python's runners is kept for the next run of its lesson (and env), three at
    most (each holds torch twice, in itself and in its fork server: about 510 and 745 MB
    resident, much of it the same library pages), and only while the environment is the one
    it started with. Its stdout and stderr are files, appended to by the runner, its
    fork server and every rank: a run's output is what they grew by while it ran."""

    running = {}  # (script, its env's items) -> LessonRunner, the most recently used last

    @classmethod
    def for_lesson(cls, script, env=None):
        key = (script, tuple(sorted((env or {}).items())))
        runner = cls.running.pop(key, None)
        if runner and runner.environment != environment():
            runner.close()  # a test changed the environment: a new runner starts in it
            runner = None
        runner = runner or cls(script, env or {})
        cls.running[key] = runner
        while len(cls.running) > 3:
            cls.running.pop(next(iter(cls.running))).close()
        return runner

    def __init__(self, script, env):
        self.key = (script, tuple(sorted(env.items())))
        self.environment = environment()
        self.folder = tempfile.mkdtemp(prefix="lesson-runner-")
        self.outputs = [os.open(os.path.join(self.folder, name),
                                os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
                        for name in ("stdout", "stderr")]
        requests_read, self.requests = os.pipe()
        self.answers, answers_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "lesson_runner.py"), str(requests_read),
             str(answers_write), script],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.outputs[0], stderr=self.outputs[1],
            pass_fds=(requests_read, answers_write), start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
        os.close(requests_read)
        os.close(answers_write)
        self.answer_lines = os.fdopen(self.answers, "r")

    def run(self, command, timeout):
        """subprocess.run(command, capture_output=True, text=True, timeout=timeout), here."""
        sizes = [os.fstat(fd).st_size for fd in self.outputs]
        os.write(self.requests, (json.dumps(command[2:]) + "\n").encode())
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answer_lines.readline() if ready else None
        if not line:  # it ran past the timeout (None), or the runner itself ended ("")
            if line is None:
                os.killpg(self.process.pid, signal.SIGKILL)  # the runner, its server, ranks
                deadline = time.monotonic() + 10  # each ends once the kernel has delivered it
                while live_processes_in_group(self.process.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
            self.process.wait()
        stdout, stderr = (os.pread(fd, os.fstat(fd).st_size - size, size)
                          .decode().replace("\r\n", "\n").replace("\r", "\n")
                          for fd, size in zip(self.outputs, sizes, strict=True))
        if not line:
            del self.running[self.key]
            self.close()
        if line is None:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        code = int(line) if line else self.process.returncode
        return subprocess.CompletedProcess(command, code, stdout, stderr)

    def close(self):
        os.close(self.requests)  # the runner reads the end of its requests, and leaves
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.answer_lines.close()
        for fd in self.outputs:
            os.close(fd)
        shutil.rmtree(self.folder, ignore_errors=True)


def environment():
    """This Python's environment, less the name of the test that pytest keeps in it."""
    return {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}


@atexit.register
def close_runners():
    while LessonRunner.running:
        LessonRunner.running.popitem()[1].close()


def check_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def read_metrics(out_dir):
    with open(Path(out_dir) / "metrics.json") as f:
        return json.load(f)


def load_weights(out_dir, name="final.pt"):
    return torch.load(Path(out_dir) / name, map_location="cpu", weights_only=True)


def import_lesson(lesson):
    """Import a lesson's train.py as a module (tests may share; lessons may not)."""
    # train.py imports guard_rails.py, model.py, data.py and its own modules from its folder, as
    # when a learner runs it. Every lesson has files of those names, each its own: the ones a
    # lesson imported before in this process are forgotten, and its folder goes first.
    folder = str(ROOT / lesson)
    for path in (ROOT / lesson).glob("*.py"):
        sys.modules.pop(path.stem, None)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"lesson_{lesson}", ROOT / lesson / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_guard_rails(lesson="02_multi_gpu_spawn"):
    """The guard_rails.py beside lesson's train.py: each lesson's holds what its files use
    (tools/make_guard_rails.py)."""
    import_lesson(lesson)
    return sys.modules["guard_rails"]


def evaluate_single_process(out_dir):
    """Lesson 01's model and test set, one process: the reference for any lesson's final.pt."""
    lesson01 = import_lesson("01_single_gpu")
    model = lesson01.WineMLP()
    model.load_state_dict(load_weights(out_dir))
    _, test_set = lesson01.load_data()
    with torch.no_grad():
        predictions = model(test_set.features).argmax(dim=1)
    return int((predictions == test_set.labels).sum()), len(test_set)


def max_weight_difference(out_dir_a, out_dir_b):
    a, b = load_weights(out_dir_a), load_weights(out_dir_b)
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_one_line_error(result, *fragments):
    """Bad input: non-zero exit, no traceback, one line starting 'error:' that names the fix."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def assert_prints_what_the_readme_shows(printed, lesson, command):
    """A proof's output holds its README's ```text block right after the ```bash block that runs
    `command` (its line, a trailing comment aside), as tools/check_listings.py holds a listing's
    output to it: the check for a listing marked `same as` the test that runs its command."""
    from check_listings import first_missing  # tools/, on sys.path (conftest.py)

    text = (ROOT / lesson / "README.md").read_text()
    after = text.split(f"```bash\n{command}", 1)[1]
    rest = after.split("\n", 1)[0].strip()  # the command's line: nothing more, or a comment
    assert rest == "" or rest.startswith("#"), f"{command}{rest}"
    shown = after.split("```text\n", 1)[1].split("\n```", 1)[0].splitlines()
    missing = first_missing(printed, shown)
    assert missing is None, f"the README shows {missing!r}, not in this run's output:\n{printed}"


def assert_good_run(result, out_dir, world_size, min_accuracy=0.9):
    """What every lesson's run must show: exit 0, files, one summary, falling loss, accuracy."""
    check_ok(result)
    out_dir = Path(out_dir)
    for name in ("metrics.json", "final.pt"):
        assert (out_dir / name).is_file(), f"{name} missing in {out_dir}"
    metrics = read_metrics(out_dir)
    assert metrics["world_size"] == world_size
    losses = metrics["train_loss"]
    assert len(losses) == metrics["epochs"]
    assert losses[-1] < losses[0], losses
    assert metrics["test_total"] == 36
    assert metrics["test_accuracy"] == metrics["test_correct"] / metrics["test_total"]
    assert metrics["test_accuracy"] >= min_accuracy, metrics
    # Rank 0 alone prints: one summary line and one line per epoch, however many ranks ran.
    assert result.stdout.count("test accuracy:") == 1, result.stdout
    assert result.stdout.count(f"epoch   1/{metrics['epochs']}") == 1, result.stdout
    # final.pt is the plain model's state_dict: lesson 01's keys, no "module." prefix.
    assert list(load_weights(out_dir)) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    return metrics


def fsdp_rows(rows, rank, world_size):
    """The rows of a tensor that FSDP gives a rank: chunks of ceil(rows / N), the last short."""
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_nodes(commands, timeout=240):
    """Start one command per node at once (node 0 first), wait for all; their results in order.

    commands: (argv, env) pairs. Each node is its own process tree, as on separate machines.
    Output goes to files, not pipes, so a talkative node cannot block on a full pipe. A node
    still running at the timeout is killed and its result says so (a negative exit status), so
    that a hang fails the test that asserts on it, not the fixture that started it."""
    nodes, logs = [], []
    for argv, env in commands:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        nodes.append(subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **env}))
    try:
        deadline = time.monotonic() + timeout
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        late = {node.pid for node in nodes if node.poll() is None}
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    results = []
    for node, (out, err) in zip(nodes, logs, strict=True):
        out.seek(0), err.seek(0)
        stderr = err.read() + (f"\nkilled: still running after {timeout} s\n"
                               if node.pid in late else "")
        results.append(subprocess.CompletedProcess(node.args, node.returncode, out.read(),
                                                   stderr))
        out.close(), err.close()
    return results


def run_torchrun(lesson, *args, nproc=2, torchrun_args=(), env=None, timeout=240, patch=None):
    """`torchrun --standalone --nproc-per-node N [torchrun_args] <lesson>/train.py args...`, as a
    learner types it (python -m torch.distributed.run is the same program), with torchrun's own
    MASTER_* only."""
    script = [str(ROOT / lesson / "train.py")]
    if patch:
        script = [str(ROOT / "tests" / "patched_lesson.py"), script[0], patch]
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), *map(str, torchrun_args), *script, *map(str, args)]
    return subprocess.run(command, cwd=ROOT, env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def run_torchrun_nodes(lesson, *args, nproc=1, timeout=240, check=True):
    """Two torchrun "nodes" on this machine, node ranks 0 and 1, nproc ranks each, meeting at a
    free loopback port, both running `<lesson>/train.py args...`; their finished processes.
    check: both must exit 0, else the failure shows both nodes' output (a node that lost its
    peer says so; the cause is in the other one's)."""
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         str(nproc), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
         str(port), str(ROOT / lesson / "train.py"), *map(str, args)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    done = []
    for node in nodes:
        out, err = node.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    if check:
        assert [node.returncode for node in done] == [0, 0], "\n".join(
            f"node {rank}: exit {node.returncode}\n{node.stdout}\n{node.stderr}"
            for rank, node in enumerate(done))
    return done


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def live_processes_in_group(group):
    """Pids of the processes of a process group that are still alive (zombies do not count)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we looked
        state, process_group = fields[0], int(fields[2])
        if process_group == group and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


def signal_states(group):
    """For each live process of a process group: its command line and how it holds signals
    (the SigPnd, SigBlk, SigIgn and SigCgt masks of /proc/PID/status), for a failure message."""
    states = {}
    for pid in live_processes_in_group(group):
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # it ended while we looked
        masks = [line.replace("\t", " ") for line in status
                 if line.split(":")[0] in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")]
        states[pid] = f"{command[:80]} | {', '.join(masks)}"
    return states


# A command typed in a terminal starts with SIGINT at its default action. A test run started in
# the background by a script (`python -m pytest &`, nohup) ignores SIGINT, and so does every
# process it starts (bash(1), SIGNALS: without job control, asynchronous commands ignore SIGINT),
# and Python turns SIGINT into KeyboardInterrupt only "if the parent process has not changed it"
# (the signal module's docs): Ctrl-C would reach no process of the lesson. interrupt_when starts
# its command through this line, which puts SIGINT back to its default, then runs the command.
AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.argv[1], sys.argv[1:])")


def interrupt_when(command, marker, timeout=180):
    """Start command in its own process group, as from a terminal, wait for a stdout line
    starting with marker, then press Ctrl-C: SIGINT to the whole group, as a terminal sends it.
    Returns (finished process, seconds it took to end after Ctrl-C, pids of the group still alive
    10 s after it ended). command[0] is the program's full path, such as sys.executable."""
    process = subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL, *map(str, command)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        seen = []
        for line in process.stdout:
            seen.append(line)
            if line.startswith(marker):
                break
        pressed = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Still running a minute after Ctrl-C: say how each process held the signal
            # (blocked, ignored, pending), then stop them all, so that the run does not go on
            # loading the machine for the rest of the suite.
            states = signal_states(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"still running 60 s after Ctrl-C; per process: {states}")
        took = time.monotonic() - pressed
    finally:
        watchdog.cancel()
    deadline = time.monotonic() + 10
    while live_processes_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = live_processes_in_group(process.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    result = subprocess.CompletedProcess(command, process.returncode, "".join(seen) + out, err)
    return result, took, left


@contextlib.contextmanager
def small_disk(path):
    """A 1 MiB tmpfs mounted at path for the with block, then unmounted; the with block gets a
    function that remounts it read-only (root ignores file modes, not a read-only mount).
    Mounting needs root: elsewhere the test is skipped, with the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8), to mount a small tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    finally:
        subprocess.run(["umount", str(path)], check=True)


def assert_final_pt_holds_cpu_tensors(out_dir):
    """final.pt, loaded with no map_location, lands on the CPU: trained on a GPU, it still
    loads into lesson 01's model on a machine without one."""
    saved = torch.load(out_dir / "final.pt", weights_only=True)
    assert {tensor.device.type for tensor in saved.values()} == {"cpu"}
