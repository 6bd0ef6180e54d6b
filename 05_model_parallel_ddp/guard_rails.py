"""Guard rails: what turns a mistake into one line that names the fix, instead of a traceback
or a hang.

This file is the same, byte for byte, beside every lesson's train.py (tests/test_repo.py fails if
one copy differs), so that a lesson's diff from the one before shows only what it teaches. A
lesson imports the guard rails it needs by name. Nothing here is needed to understand DDP: read
it when a message surprises you.
"""

import contextlib
import datetime
import hashlib
import importlib.util
import io
import ipaddress
import json
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ---------------------------------------------------------------------------------------------
# Every lesson: flags, launcher, --out-dir, Ctrl-C
# ---------------------------------------------------------------------------------------------

def fail(message):
    """Stop with one line that says what is wrong and how to fix it (no traceback)."""
    sys.exit(f"error: {message}")


def check_args(args):
    """Refuse a value that cannot work, naming its flag (a flag the lesson lacks is skipped)."""
    for name in ("epochs", "batch_size", "save_every", "world_size", "nnodes", "nproc_per_node",
                 "crash_at_epoch"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    for name in ("lr", "timeout"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            fail(f"--{name} must be positive (got {value:g})")
    return args


def started_by_torchrun():
    # torchrun sets TORCHELASTIC_RUN_ID, with RANK, LOCAL_RANK and WORLD_SIZE, in every process
    # it starts.
    return "TORCHELASTIC_RUN_ID" in os.environ


def check_launcher(torchrun_ok):
    """Name the right command when a launcher the lesson is not written for started it."""
    if started_by_torchrun() and not torchrun_ok:
        fail(f"{sys.argv[0]} is not written for torchrun, which starts only lessons 03 to 07; "
             f"start it with: python {sys.argv[0]}")


def check_out_dir(path):
    """--out-dir must be a folder this process can write to, or become one."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"--out-dir {path} is a file, not a folder; choose another --out-dir")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        fail(f"--out-dir {path} cannot be created ({error.strerror}); choose another --out-dir")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"--out-dir {path} is not writable by this user; choose another --out-dir")


def start(entry, parse, torchrun_ok):
    """Check how the lesson was started, its flags and where it writes, then run entry(args)."""
    try:
        check_launcher(torchrun_ok)
        args = parse()
        check_out_dir(args.out_dir)
        entry(args)
    except SystemExit as stop:
        # torchrun runs one copy per rank, and each would print the same line: rank 0 says it.
        if started_by_torchrun() and os.environ.get("RANK") != "0" and stop.code:
            sys.exit(1)
        raise
    except KeyboardInterrupt:
        # Ctrl-C: one line instead of the traceback of wherever the program happened to be.
        # The terminal sent it to the ranks too, and they stop; any still running is stopped
        # here, so that none is left behind.
        for child in mp.active_children():
            child.terminate()
            child.join(timeout=10)
        if not started_by_torchrun() or os.environ.get("RANK") == "0":
            print("error: interrupted (Ctrl-C); the run stopped before it finished",
                  file=sys.stderr)
        sys.exit(130)


# ---------------------------------------------------------------------------------------------
# Lessons with ranks (02 to 07): the port, ranks that fail, stall or lose each other
# ---------------------------------------------------------------------------------------------

def port_in_use(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR, as the rendezvous server itself sets it: a port that only lingers in
        # TIME_WAIT after an earlier run is free; one that a live server listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def check_master_port():
    """A MASTER_PORT set in the environment must be a port number that nothing listens on."""
    port = os.environ.get("MASTER_PORT")
    if port is None:
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"MASTER_PORT={port} is not a port number; unset it to use a free port")
    if port_in_use(int(port)):
        fail(f"MASTER_PORT={port} is already in use on this machine; choose another "
             "(export MASTER_PORT=29501) or unset it to use a free port")


@contextlib.contextmanager
def rank_guard(rank, args, meet_fix="raise --timeout if this machine is very busy",
               lost_fix="another rank stopped, or stalled longer than --timeout; its output "
                        "says which"):
    """Around one rank's work: ranks that do not meet, or lose each other, end with one line
    each, and Ctrl-C quietly; the rank leaves the process group however it ends, and its
    process through leave_process, except for a failure of its own under mp.spawn, which goes
    on up to spawn (spawn shows its traceback and names the rank)."""
    code = 0
    try:
        yield
    except KeyboardInterrupt:
        code = 130  # Ctrl-C reached every process: the launcher says so, once
    except SystemExit as stop:
        # This rank stopped with its own line (sys.exit), which Python would print on its way
        # out: printed here instead (under torchrun, rank 0's alone, as start() does).
        code = 1 if isinstance(stop.code, str) else stop.code or 0
        if isinstance(stop.code, str) and not (started_by_torchrun() and rank != 0):
            print(stop.code, file=sys.stderr)
    except Exception as error:
        code = 1
        if is_lost_contact(error):
            # Printed here, not by fail(): each rank has its own story, and under torchrun
            # start() keeps only rank 0's copy of the lines that every rank shares.
            print(f"error: {lost_contact_line(error, rank, args, meet_fix, lost_fix)}",
                  file=sys.stderr)
        elif started_by_torchrun():
            # This rank's own failure, with its traceback as Python would print it on its way
            # out (torch puts [rankN] before each line); then the rank leaves with exit code 1.
            sys.excepthook(type(error), error, error.__traceback__)
        else:
            raise  # this rank's own failure: spawn shows its traceback and names the rank
    finally:
        # Also when training fails, so this rank does not leave its peers hanging.
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_process(code)  # the work ended well (0), or with its one line (1) or Ctrl-C (130)


def lost_contact_line(error, rank, args, meet_fix, lost_fix):
    """What a rank that lost the others says: gloo's or the store's first line, without its
    source location and advice, and what to do."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    reason = reason.split("] ", 1)[-1].split(". ")[0][:160]
    if not dist.is_initialized():
        return (f"rank {rank}: not all {args.world_size} ranks met at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within "
                f"{args.timeout:g} s ({reason}); {meet_fix}")
    return f"rank {rank} lost contact with the other ranks ({reason}); {lost_fix}"


def leave_process(code=0):
    """The teardown workaround: a rank whose work is done and written, or that has said why it
    stopped, leaves at once with that exit code.

    With torch 2.14, gloo's threads can outlive destroy_process_group, and Python tearing down
    the interpreter under them sometimes aborts the rank ("terminate called without an active
    exception"): a job whose results are on disk fails, and a rank that printed its one-line
    error or its traceback dies with exit code -6, so the launcher adds a second, wrong line
    (torchrun: "Signal 6 (SIGABRT)"). Seen in lesson 07 (ZeRO-1) about 1 run in 25, after "lost
    contact" in lesson 03, and in about 1 torchrun run in 10 where a rank raised;
    `python tools/repro_teardown.py --lesson 07_sharding` counts it with and without this
    function, and with --crash for a rank that raises under torchrun. Upstream:
    pytorch/pytorch#190489 and the abandoned pytorch/pytorch#179291 (gloo work that outlives
    the interpreter)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_lost_contact(error):
    """Whether error says that the other ranks did not come, went away or stalled: the store's
    and the network's errors, or a backend's (gloo, NCCL) whose text says so. Any other backend
    error, such as NCCL's "Duplicate GPU detected", is this rank's own and keeps its traceback.
    In backward, autograd hands on gloo's error as a plain RuntimeError, hence the look at the
    text."""
    if isinstance(error, (dist.DistStoreError, dist.DistNetworkError)):
        return True
    signs = ("connection reset by peer", "connection closed by peer", "connection refused",
             "timed out", "timeout", "broken pipe", "remote process exited", "network error")
    return isinstance(error, RuntimeError) and any(sign in str(error).lower() for sign in signs)


@contextlib.contextmanager
def spawn_guard(what, then=""):
    """Around mp.spawn: a rank that fails or dies becomes one line naming it (not a traceback
    of spawn's), and the job ends; spawn has already stopped the other ranks."""
    try:
        yield
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        fail(f"{what} {error.error_index} failed (its traceback is above); the other {what}s "
             f"were stopped{then}")
    except mp.ProcessExitedException as error:
        if error.exit_code == 130:
            raise KeyboardInterrupt from None  # a rank stopped by Ctrl-C
        if error.exit_code == 1:
            sys.exit(1)  # the rank stopped with its own one-line error, printed above
        fail(f"{what} {error.error_index} died with exit code {error.exit_code} (killed, or out "
             f"of memory?); the other {what}s were stopped{then}")


# ---------------------------------------------------------------------------------------------
# Lesson 03: nodes started with flags that cannot meet
# ---------------------------------------------------------------------------------------------
# Flags for launching by hand; under torchrun they belong to torchrun's command line.
MANUAL_LAUNCH_FLAGS = ("nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port")


def check_node_flags(args):
    if args.node_rank is not None and args.node_rank < 0:
        fail(f"--node-rank must be 0 or more (got {args.node_rank})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        fail(f"--master-port must be a port number, 1 .. 65535 (got {args.master_port})")
    return args


def is_local_address(address):
    # Rank 0 runs on node 0 and listens there, so node 0's --master-addr must be one of its own
    # addresses. Binding to an address that belongs to another machine fails.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((socket.gethostbyname(address), 0))
    except OSError:
        return False
    return True


def is_loopback(address):
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except OSError:
        return False


def check_gloo_address(master_addr, nnodes):
    """Fail early where gloo would listen on the loopback address, unreachable from other nodes.

    gloo listens on the address this machine's name resolves to. Many Linux machines map their
    name to 127.0.0.1 or 127.0.1.1 in /etc/hosts: fine on one machine, but ranks on other nodes
    cannot connect there, and the job would fail after --timeout at the first collective."""
    if nnodes == 1 or is_loopback(master_addr) or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = socket.gethostname()
    if is_loopback(name) or not is_local_address(name):
        fail(f"this machine's name ({name}) resolves to a loopback address, where gloo would "
             f"listen and the other nodes cannot reach it; set GLOO_SOCKET_IFNAME to the "
             f"network interface that reaches {master_addr} (ip route get {master_addr} "
             "names it)")


def wait_for_master(address, port, timeout):
    """True once something listens at address:port, False if nothing does within timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, timeout)):
                return True
        except OSError:
            # Refused (node 0 has not started yet), unreachable or timed out: try again, since
            # nodes may be started in any order, until the deadline.
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# Lessons 04 and 07: a checkpoint that cannot continue this run, or that some rank
# cannot see, and the store torchrun's restarts need
# ---------------------------------------------------------------------------------------------
SNAPSHOT_KEYS = ("model", "optimizer", "epochs_completed", "train_loss", "world_size",
                 "settings")


def run_settings(args):
    """The flags that define a run: a snapshot continues only a run with the same ones. The
    number of ranks may change (see lesson 04's main); --epochs may grow; the others change no
    result."""
    return {"lr": args.lr, "seed": args.seed, "batch-size": args.batch_size}


def check_snapshot(path, args, make_model):
    """None if there is no snapshot at path; else what every rank must find there (epochs
    done, world size, the file's SHA-256). Stops with one line if it cannot be resumed into
    make_model() with these flags."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    try:
        # weights_only=True loads tensors and plain containers only: a file that tries to
        # build other objects is refused, so a snapshot from elsewhere cannot run code.
        snapshot = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged file raises one of several types, torch's or pickle's
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        fail(f"{path} cannot be loaded ({type(error).__name__}: {reason[:150]}); it is damaged "
             "or not a snapshot: restore a good copy, or delete it to train from scratch")
    missing = [key for key in SNAPSHOT_KEYS
               if not isinstance(snapshot, dict) or key not in snapshot]
    if missing:
        fail(f"{path} is not a snapshot of this lesson (no {', '.join(missing)}); delete it or "
             "choose another --out-dir")
    if snapshot["epochs_completed"] > args.epochs:
        fail(f"{path} has {snapshot['epochs_completed']} epochs done, more than --epochs "
             f"{args.epochs}; ask for at least {snapshot['epochs_completed']} or choose another "
             "--out-dir")
    try:
        make_model().load_state_dict(snapshot["model"])  # the same layers with the same shapes?
    except RuntimeError as error:
        fail(f"{path} holds a different model ({str(error).splitlines()[-1].strip()[:150]}); "
             "delete it or choose another --out-dir")
    for flag, value in run_settings(args).items():
        saved = snapshot["settings"].get(flag)
        if saved != value:
            fail(f"--{flag} {value} differs from the run in {path}, which used --{flag} "
                 f"{saved}; resume it with --{flag} {saved}, or start a new run with another "
                 "--out-dir")
    return {"epochs_completed": snapshot["epochs_completed"],
            "world_size": snapshot["world_size"], "sha256": hashlib.sha256(data).hexdigest()}


def decided_by_rank_0(rank, decide, *decide_args):
    """decide(*decide_args) on rank 0 alone, its answer handed to every rank. If rank 0 stops
    with an error, it says so once and every rank ends, none left waiting for it."""
    answer = [None]
    if rank == 0:
        try:
            answer = [("go", decide(*decide_args))]
        except SystemExit as stop:
            answer = [("stop", stop.code)]
    dist.broadcast_object_list(answer, src=0)
    verdict, value = answer[0]
    if verdict == "stop":
        sys.exit(value if rank == 0 else 1)
    return value


def read_same_snapshot(path, expected):
    """The snapshot rank 0 decided on, as a file in memory, once every rank has checked that
    it sees that very file; else the job stops with one line, not a hang."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        seen = hashlib.sha256(data).hexdigest()
    except OSError as error:
        data, seen = None, f"cannot read {path} ({error.strerror})"
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), seen))
    for other, (host, other_seen) in enumerate(views):
        if other_seen != expected["sha256"]:
            what = (other_seen if other_seen.startswith("cannot read") else
                    f"sees another version of {path}")
            sys.exit(f"error: rank {other} (host {host}) {what}, the snapshot that rank 0 "
                     f"resumes from at epoch {expected['epochs_completed'] + 1}; every rank must "
                     "see the same --out-dir, on a filesystem shared by all nodes"
                     if dist.get_rank() == 0 else 1)
    return io.BytesIO(data)


def restart_store(rank, world_size, timeout):
    """None (init_process_group builds the store from MASTER_ADDR and MASTER_PORT), except in a
    torchrun restart that shares its agent's store: then that store, with a prefix per attempt.

    torchrun's agent hosts one store for the whole job, across restarts (--standalone and the
    c10d rendezvous, torch 2.4 to 2.14), and hands it to every attempt. The ranks of a
    restarted attempt would find the keys of the failed one in it, such as the addresses of
    ranks that are gone, and fail ("Connection refused") or hang. A prefix per attempt keeps
    each attempt's keys its own. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's
    environment, PyTorch's own switch, every attempt gets a fresh store and this returns None.
    On several nodes with the c10d rendezvous only the switch works: torchrun also restarts a
    node's ranks when another node's failed, without counting it, so the nodes' counts and
    prefixes can differ, and the restarted ranks wait --timeout for each other; rank 0 says so
    when such a job starts. tools/repro_agent_store.py reproduces both (--nodes 2); upstream:
    pytorch/pytorch#135712."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if (shared and nodes > 1 and attempt == 0 and rank == 0
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        print(f"note: torchrun may restart these ranks on {nodes} nodes, with one store for "
              "every attempt; with the c10d rendezvous, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "for torchrun on every node, or a restart can wait --timeout for ranks that never "
              "come (pytorch/pytorch#135712)", flush=True)
    if attempt == 0 or not shared:
        return None
    return dist.PrefixStore(
        f"attempt_{attempt}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                      is_master=False, timeout=datetime.timedelta(seconds=timeout)))


# ---------------------------------------------------------------------------------------------
# Lesson 06: flag values that cannot work, and what the chosen device cannot do
# ---------------------------------------------------------------------------------------------
def check_practice_args(args):
    """This lesson's flags: the values that cannot work, and what the chosen device cannot do."""
    if args.accumulate < 1:
        fail(f"--accumulate must be at least 1 (got {args.accumulate})")
    for name in ("clip_grad_norm", "warmup_steps"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be 0 or more (got {getattr(args, name)})")
    on_gpu = args.backend == "nccl"
    if args.precision == "fp16" and not on_gpu:
        fail("--precision fp16 needs CUDA GPUs (fp16 autocast with a GradScaler); on the CPU "
             "use --precision bf16")
    if args.compile:
        # torch.compile's CPU code (and its GPU launchers) are C++ that Inductor compiles with
        # $CXX, else g++ (clang++ on macOS, cl on Windows): torch/_inductor/config.py, cpp.cxx.
        default = {"darwin": "clang++", "win32": "cl"}.get(sys.platform, "g++")
        compiler = os.environ.get("CXX", default)
        if shutil.which(compiler) is None:
            fail(f"--compile needs a C++ compiler and {compiler} is not on the PATH; install "
                 "one (or set CXX to it), or leave out --compile")
        if on_gpu and importlib.util.find_spec("triton") is None:
            fail("--compile on GPUs needs triton (pip install triton), or leave out --compile")


# ---------------------------------------------------------------------------------------------
# Lesson 07: a width or a checkpoint folder that cannot continue this run
# ---------------------------------------------------------------------------------------------
def check_sharding(args, latest_checkpoint):
    """Refuse, before any rank starts, a width or a checkpoint that cannot work."""
    if args.hidden < 1:
        fail(f"--hidden must be at least 1 (got {args.hidden})")
    checkpoint = latest_checkpoint(os.path.join(args.out_dir, "checkpoint"))
    if checkpoint:
        check_checkpoint(checkpoint, args)


def check_checkpoint(path, args):
    """Stop with one line if the checkpoint in path cannot go on as this run asks."""
    import torch.distributed.checkpoint as dcp  # lesson 07 alone needs it

    try:
        # DCP's .metadata is a pickle, read with pickle.load (not weights_only): resume only
        # from checkpoints you or your job wrote. The shards themselves load weights_only.
        metadata = dcp.FileSystemReader(path).read_metadata()
        with open(os.path.join(path, "progress.json")) as f:
            done = json.load(f)["epochs_completed"]
        hidden = metadata.state_dict_metadata["model.fc1.weight"].size[0]
    except Exception as error:  # a damaged folder raises one of several types
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        fail(f"{path} cannot be loaded ({type(error).__name__}: {reason[:150]}); it is damaged "
             "or not a checkpoint of this lesson: delete it or choose another --out-dir")
    if hidden != args.hidden:
        fail(f"{path} holds a model with --hidden {hidden}, not {args.hidden}; resume with "
             f"--hidden {hidden}, or delete it or choose another --out-dir")
    if done > args.epochs:
        fail(f"{path} has {done} epochs done, more than --epochs {args.epochs}; ask for at "
             f"least {done} or choose another --out-dir")


def agree_on_checkpoint(rank, checkpoint_dir, latest_checkpoint):
    """The checkpoint to resume from (None: start afresh), chosen by rank 0 for every rank,
    once every rank has shown that it sees the folder rank 0 writes to. Else one line from
    rank 0, and the job stops before it trains.

    Every rank writes its own shards into that folder and reads them all back on resume. On
    one machine it is one folder; across nodes it is one only on a filesystem they share. On
    disks of their own, each node would keep its ranks' shards and rank 0 alone .metadata: a
    checkpoint that no node could load, found only at the resume."""
    note = os.path.join(checkpoint_dir, ".rank0")
    choice = [None, None]  # [checkpoint or None, what rank 0 wrote into the note]
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        choice = [latest_checkpoint(checkpoint_dir), f"{socket.gethostname()} {time.time_ns()}"]
        with open(note, "w") as f:
            f.write(choice[1])
    dist.broadcast_object_list(choice, src=0)  # after the write: the others look only now
    try:
        with open(note) as f:
            sees = f.read() == choice[1]
    except OSError:
        sees = False
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), sees))
    if rank == 0:
        os.remove(note)
    blind = [f"rank {r} (host {host})" for r, (host, sees) in enumerate(views) if not sees]
    if blind:
        sys.exit(f"error: {', '.join(blind)} cannot see {checkpoint_dir}, where rank 0 writes; "
                 "every rank writes its shards of the checkpoint there and reads them back, so "
                 "give every node the same --out-dir on a filesystem they all share"
                 if rank == 0 else 1)
    return choice[0]
