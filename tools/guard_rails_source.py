"""The course's guard rails, in one source: what turns a mistake into one line that names the
fix, instead of a traceback or a hang.

Nothing imports this file. tools/make_guard_rails.py writes each lesson's guard_rails.py from
it, with the parts that lesson's files use (tests/test_repo.py checks that every copy is
current): edit here, then run python tools/make_guard_rails.py. A statement that runs at import
is kept only in the lessons that import the module its comment names ("# Lessons that import").
"""

import contextlib
import datetime
import errno
import gc
import hashlib
import importlib.util
import io
import ipaddress
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Lessons that import torch.distributed.tensor.parallel (tools/repro_tp_fsdp_warnings.py shows
# both warnings): gathering a 2-D (FSDP x TP) model whole, for final.pt, warns once per rank that
# it takes "2 sequential all_gather operations": a note on speed, for a gather made once a run.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
# Lessons that import torch.distributed.tensor.parallel: FSDP warns that a layer split by TP
# "returned a view tensor" (TP's output, as a plain tensor, is a view of the DTensor's), which
# an in-place op could break: the lesson's model makes none.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view")
# Lessons that import torch.distributed.pipelining (tools/repro_nccl_p2p_warning.py shows it, on
# 2 GPUs): with NCCL and device_id, every rank warns once that its "unbatched P2P op
# (send/recv)" shares the group's communicator and is "serialized" with the others: the
# pipeline's sends and receives are ordered by the schedule anyway. Set at import, before any
# group or send (pytorch/pytorch#132900, #156748).
os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")

# ---------------------------------------------------------------------------------------------
# Flags, the launcher, --out-dir, Ctrl-C
# ---------------------------------------------------------------------------------------------
def fail(message):
    """Stop with one line that says what is wrong and how to fix it (no traceback)."""
    sys.exit(f"error: {message}")


def check_args(args):
    """Refuse a value that cannot work, naming its flag (a flag the lesson lacks is skipped)."""
    # Every float flag, the lesson's own included, first: nan passes every comparison below and
    # inf passes "positive", and then a run trains on nan (--lr inf) or fails deep inside torch
    # (--timeout nan).
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{name.replace('_', '-')} must be a finite number (got {value})")
    for name in ("epochs", "batch_size", "save_every", "world_size", "nnodes", "nproc_per_node",
                 "crash_at_epoch", "hidden", "layers", "dp", "tp", "stages", "microbatches",
                 "cp", "pp", "ep", "experts", "top_k", "seq_len", "dim", "heads", "profile_step"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    for name in ("lr", "timeout", "max_norm", "bucket_mb"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            fail(f"--{name.replace('_', '-')} must be positive (got {value:g})")
    # Far larger timeouts overflow inside torch and fail with words that name no flag (torch
    # 2.14, gloo: 1e10 s, the store's connect "timed out after 10000000000000ms" at once; 1e13
    # s, "Invalid timeout"); a year is more than any job waits.
    if getattr(args, "timeout", None) is not None and args.timeout > 3e7:
        fail(f"--timeout must be at most 3e7 seconds, about a year (got {args.timeout:g})")
    return args


def check_device(name):
    """torch.device(name), or one line for a --device that is not there (lesson 01)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            fail(f"--device {name} needs a CUDA GPU and none is visible; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            fail(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible")
    return device


def check_backend(requested, ranks, flag="--world-size"):
    """Refuse --backend nccl where it cannot work: NCCL needs CUDA, and a GPU for each of the
    ranks on this machine (flag: the one that set them). With --backend auto and too few GPUs
    for them, say once that the ranks train on the CPU."""
    gpus = torch.cuda.device_count()
    if requested == "nccl" and (gpus == 0 or not dist.is_nccl_available()):
        fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
    if requested == "nccl" and ranks > gpus:
        fail(f"{flag} {ranks} with NCCL needs {ranks} GPUs (one per rank), but {gpus} visible; "
             f"use {flag} {gpus} or --backend gloo")
    if requested == "auto" and 0 < gpus < ranks and os.environ.get("RANK", "0") == "0":
        print(f"note: {ranks} ranks but {gpus} GPU(s); NCCL needs one GPU per rank, so the "
              "ranks train on the CPU with gloo", flush=True)


def started_by_torchrun():
    # torchrun sets TORCHELASTIC_RUN_ID, with RANK, LOCAL_RANK and WORLD_SIZE, in every process
    # it starts.
    return "TORCHELASTIC_RUN_ID" in os.environ


def check_launcher(torchrun_ok):
    """Name the right command when a launcher the lesson is not written for started it."""
    if started_by_torchrun() and not torchrun_ok:
        fail(f"{sys.argv[0]} is not written for torchrun; start it with: python {sys.argv[0]}")


def check_out_dir(path):
    """--out-dir must be a folder this process can write to, or become one."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"--out-dir {path} is a file, not a folder; choose another --out-dir")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        fail(f"--out-dir {path} cannot be created ({error.strerror}); choose another --out-dir")
    if not os.access(path, os.W_OK | os.X_OK):
        # os.statvfs is Unix's; elsewhere a read-only disk is told as one this user cannot write.
        read_only = hasattr(os, "statvfs") and os.statvfs(path).f_flag & os.ST_RDONLY
        why = "is on a read-only filesystem" if read_only else "is not writable by this user"
        fail(f"--out-dir {path} {why}; choose another --out-dir")


def start(main, parse, launch=None, torchrun_ok=False):
    """Check how the lesson was started, its flags and where it writes, then run main(args), or
    launch(main, args): the lesson's own way of starting the ranks that each run main."""
    checked = False
    try:
        check_launcher(torchrun_ok)
        args = parse()
        check_out_dir(args.out_dir)
        checked = True
        launch(main, args) if launch else main(args)
    except SystemExit as stop:
        # torchrun runs one copy per rank, and each would print the same line: rank 0 says it.
        if started_by_torchrun() and os.environ.get("RANK") != "0" and stop.code:
            if not checked or isinstance(stop.code, str):
                # Every rank fails these checks, and the launcher's own (fail: a line, before
                # the ranks meet), alike, and torchrun stops the others once one has left
                # (torch/distributed/elastic/agent/server/api.py, _invoke_run): a rank that left
                # first could stop rank 0 before its line. So this one waits, and rank 0's exit
                # ends the wait (a rank on another node's waits at most 10 s).
                time.sleep(10)
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
    finally:
        leave_quickly()


def leave_quickly():
    """Shorten what follows the end of the job, ended well or not: its ranks are gone and its
    files written. Measured with tools/repro_slow_exit.py (lesson 02, on a 2-core machine), this
    takes the 3 to 4 s between the last line and the end of the output to under half a second.

    - Stop the fork server of start_ranks (lesson 02's README), if there is one. Left alone, it
      leaves only after the launcher has left, and then takes 2 to 3 s to tear down a Python
      that imported torch, all the while holding the launcher's stdout and stderr open: a pipe
      (`python train.py | tee log`, a test reading the output) ends only when it has. It holds
      nothing the job needs once its ranks have ended. Python keeps its pid in a private
      attribute (multiprocessing/forkserver.py, Python 3.8 to 3.14); without it, the server
      leaves on its own, as before. SIGTERM ends it without a teardown: it handles only SIGCHLD
      and SIGINT.
    - Freeze the launcher's objects (gc.freeze): the interpreter's teardown then skips its last
      garbage collection over torch's objects, which live until the exit anyway (about 1 s)."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)  # a later start_ranks starts a new one (ensure_running)
    gc.freeze()


# ---------------------------------------------------------------------------------------------
# Flags of one lesson that cannot work
# ---------------------------------------------------------------------------------------------
def check_device_plan(plan_devices, requested, gpus, world_size, flag):
    """Lesson 05's plan_devices(gpus, world_size, flag) as (world_size, devices), or one line
    where it cannot work: --backend nccl without a GPU, or more ranks than GPU pairs (the plan's
    ValueError). The plan's note is said once (under torchrun, by rank 0)."""
    if requested == "nccl" and gpus == 0:
        fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
    try:
        world_size, devices, note = plan_devices(gpus, world_size, flag)
    except ValueError as error:
        fail(error)
    if note and os.environ.get("RANK", "0") == "0":
        print(note, flush=True)
    return world_size, devices


def check_practice_args(args):
    """Every lesson's checks (check_args), then this lesson's: flag values that cannot work, and
    what the device the ranks will train on cannot do. Returns args, as check_args does."""
    check_args(args)
    if args.accumulate < 1:
        fail(f"--accumulate must be at least 1 (got {args.accumulate})")
    for name in ("clip_grad_norm", "warmup_steps"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be 0 or more (got {getattr(args, name)})")
    # On GPUs where train.py's choose_backend will pick NCCL: from the ranks on this machine
    # (torchrun's LOCAL_WORLD_SIZE, else --world-size), one GPU each.
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    on_gpu = args.backend == "nccl" or (args.backend == "auto" and dist.is_nccl_available()
                                        and 0 < ranks_here <= torch.cuda.device_count())
    if args.precision == "fp16" and not on_gpu:
        fail("--precision fp16 needs CUDA GPUs (fp16 autocast with a GradScaler); on the CPU "
             "use --precision bf16")
    if args.compile:
        if on_gpu and importlib.util.find_spec("triton") is None:
            fail("--compile on GPUs needs triton (pip install triton), or leave out --compile")
        language, variable, compiler = compiler_for_compile(on_gpu)
        if compiler is None or shutil.which(compiler) is None:
            found = f"{compiler} is not" if compiler else "neither gcc nor clang is"
            fail(f"--compile needs a {language} compiler and {found} on the PATH; install one "
                 f"(or set {variable} to it), or leave out --compile")
    return args


def compiler_for_compile(on_gpu):
    """The compiler torch.compile will call: (language, its variable, the command or None).

    On GPUs, Inductor's kernels are Triton's, and Triton builds its kernel launchers from C
    with $CC, else gcc, else clang (triton/runtime/build.py, _find_compiler). On the CPU,
    Inductor's kernels are C++, built with $CXX, else g++ (clang++ on macOS, cl on Windows):
    torch/_inductor/config.py, cpp.cxx."""
    if on_gpu:
        return "C", "CC", os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    default = {"darwin": "clang++", "win32": "cl"}.get(sys.platform, "g++")
    return "C++", "CXX", os.environ.get("CXX", default)


def check_sharding(args, latest_checkpoint):
    """Refuse, before any rank starts, a width or a checkpoint that cannot work."""
    if getattr(args, "hidden", 1) < 1:
        fail(f"--hidden must be at least 1 (got {args.hidden})")
    checkpoint = latest_checkpoint(os.path.join(args.out_dir, "checkpoint"))
    if checkpoint:
        check_checkpoint(checkpoint, args)


def check_tensor_parallel(args):
    """Refuse, before any rank starts, a --dp x --tp mesh that cannot split this model."""
    if args.dp is None:  # torchrun's ranks, or else the GPUs, in TP groups of --tp; at least 1
        ranks = args.world_size if started_by_torchrun() else torch.cuda.device_count()
        args.dp = max(1, ranks // args.tp)
    if started_by_torchrun() and args.dp * args.tp != args.world_size:
        fail(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} ranks, but torchrun "
             f"started {args.world_size}; start dp x tp processes in all, or change --dp or --tp")
    if args.hidden % args.tp:
        fail(f"--tp {args.tp} does not divide --hidden {args.hidden}: each rank of a TP group "
             f"holds hidden / tp of every layer's units; choose a --tp that divides {args.hidden}")
    if args.tp > 1 and args.layers % 2 == 0:
        fail(f"--layers {args.layers} makes {args.layers + 1} linear layers, and tensor "
             "parallelism splits them in pairs (column-wise, then row-wise); use an odd --layers")
    if started_by_torchrun() and os.environ.get("RANK") == "0":  # one line, not one per rank
        note_groups_across_nodes(args.tp, args.dp, int(os.environ["LOCAL_WORLD_SIZE"]))


def note_groups_across_nodes(tp, dp, per_node):
    """Say so when a TP group spans nodes: tp is the mesh's innermost dimension, so TP group g
    is ranks g*tp .. g*tp + tp - 1 (dp groups in lesson 09, dp x pp in 13), and torchrun gives
    node n ranks n*per_node onwards (every node the same --nproc-per-node: check_nodes)."""
    groups = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    across = [g for g in groups if g[0] // per_node != g[-1] // per_node]
    if across:
        print(f"note: --tp {tp} does not divide the {per_node} ranks of a node: TP group "
              f"{across[0]} spans nodes {across[0][0] // per_node} to {across[0][-1] // per_node}, "
              "and its collectives cross the network at every layer; a --tp that divides "
              "--nproc-per-node keeps each group on one node", flush=True)


def check_pipeline(args):
    """Refuse, before any rank starts, --stages, --microbatches or --schedule that cannot work."""
    if args.dp is None:  # torchrun's ranks, or else the GPUs, in pipelines of --stages; at least 1
        ranks = args.world_size if started_by_torchrun() else torch.cuda.device_count()
        args.dp = max(1, ranks // args.stages)
    if started_by_torchrun() and args.dp * args.stages != args.world_size:
        fail(f"--dp {args.dp} x --stages {args.stages} = {args.dp * args.stages} ranks, but "
             f"torchrun started {args.world_size}; start dp x stages processes in all, or "
             "change --dp or --stages")
    chunks = 2 if args.schedule in ("interleaved", "zbv", "dualpipev") else 1  # stages a rank
    pieces, linears = args.stages * chunks, args.layers + 1
    if linears % pieces:
        over = f"--stages {args.stages}" + (f" x {chunks} chunks per rank (--schedule "
                                            f"{args.schedule}) = {pieces}" if chunks > 1 else "")
        fail(f"--layers {args.layers} makes {linears} linear layers, which do not split evenly "
             f"over {over} stages; use a --layers one less than a multiple of {pieces}, such "
             f"as --layers {pieces * max(1, linears // pieces) - 1}")
    if args.batch_size % args.microbatches:
        fail(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}: "
             "every micro-batch must have the same shape (the pipeline fixes it at the first "
             "step); choose a --batch-size that is a multiple of --microbatches")
    # What torch's schedules raise a ValueError for (torch 2.14, pipelining/schedules.py):
    # Schedule1F1B, fewer micro-batches than stages; ScheduleInterleaved1F1B, micro-batches
    # that do not split into max(1, m // p) equal rounds (p = 2 takes m = 1, 2, 3, 4, 6, not 5).
    if args.schedule == "1f1b" and args.microbatches < args.stages:
        fail(f"--schedule 1f1b needs at least one micro-batch per stage (torch's Schedule1F1B "
             f"refuses fewer): --microbatches {args.microbatches} is fewer than --stages "
             f"{args.stages}")
    rounds = max(1, args.microbatches // args.stages)
    if args.schedule in ("interleaved", "zb1p") and args.microbatches % rounds:
        fail(f"--schedule {args.schedule} runs the micro-batches in {rounds} equal rounds "
             f"(--microbatches // --stages): --microbatches {args.microbatches} does not split "
             f"into them; use a multiple of {rounds}, such as {rounds * args.stages}")
    # ScheduleDualPipeV: at least one micro-batch per stage, and it places 2 on each rank.
    if args.schedule == "dualpipev" and args.microbatches < 2 * args.stages:
        fail(f"--schedule dualpipev needs at least one micro-batch per stage, 2 x --stages "
             f"{args.stages} = {2 * args.stages} (torch's ScheduleDualPipeV refuses fewer): "
             f"use --microbatches {2 * args.stages} or more")


def check_simulated_ms(args):
    """Refuse a simulated compute time below 0 (lesson 10's measure_bubble.py)."""
    for flag in ("simulate_ms", "backward_ms", "weight_ms"):
        if getattr(args, flag) < 0:
            fail(f"--{flag.replace('_', '-')} must be at least 0 (got {getattr(args, flag):g})")


def check_context_parallel(args, load_data):
    """Refuse, before any rank starts, a --dp x --cp layout that cannot split the sequences, or
    a --batch-size or --seq-len that leaves a rank no step. --dp, when not given: torchrun's
    ranks / --cp; else the most CP groups of --cp GPUs that --batch-size splits over, at least 1."""
    idle = 0  # GPUs that the chosen --dp leaves without a rank
    if started_by_torchrun() and args.dp is None:
        if args.world_size % args.cp:
            fail(f"torchrun started {args.world_size} ranks, which do not make CP groups of "
                 f"--cp {args.cp}; start a multiple of {args.cp} processes in all, or change --cp")
        args.dp = args.world_size // args.cp
    elif started_by_torchrun() and args.dp * args.cp != args.world_size:
        fail(f"--dp {args.dp} x --cp {args.cp} = {args.dp * args.cp} ranks, but torchrun "
             f"started {args.world_size}; start dp x cp processes in all, or change --dp or --cp")
    elif args.dp is None:
        gpus = torch.cuda.device_count()
        args.dp = max((d for d in range(1, gpus // args.cp + 1) if args.batch_size % d == 0),
                      default=1)
        if args.backend != "gloo" and args.cp <= gpus:  # else the ranks train on the CPU
            idle = gpus - args.dp * args.cp
    if args.seq_len % (2 * args.cp):
        fail(f"--seq-len {args.seq_len} does not split into 2 x --cp = {2 * args.cp} equal "
             f"chunks (each rank holds two); use a multiple of {2 * args.cp}")
    if args.batch_size % args.dp:
        fail(f"--batch-size {args.batch_size}, the global batch, does not split over --dp "
             f"{args.dp}; use a multiple of {args.dp}")
    if args.dim % args.heads:
        fail(f"--heads {args.heads} does not divide --dim {args.dim}: each head takes "
             f"dim / heads of every token's features")
    try:
        train, validation = (len(part) for part in load_data(args.seq_len))
    except RuntimeError:  # unfold's: a text shorter than one sequence has no window to cut
        fail(f"--seq-len {args.seq_len} is longer than a text load_data cuts (not one sequence "
             f"of {args.seq_len + 1} characters); use a shorter --seq-len")
    # Each CP group's sampler (drop_last) deals it train // dp sequences, read in whole batches
    # of batch_size // dp; validation_loss gives each group every dp-th sequence: both at least 1.
    if validation < args.dp:
        fail(f"--seq-len {args.seq_len} cuts the validation text into {validation}, fewer than "
             f"the --dp {args.dp} groups, which need one each; use a smaller --dp or a shorter "
             "--seq-len")
    if train // args.dp < args.batch_size // args.dp:
        fail(f"--batch-size {args.batch_size} leaves no step: with --dp {args.dp}, each group "
             f"reads {train // args.dp} of the {train} training sequences, in batches of "
             f"{args.batch_size // args.dp}; use a --batch-size of at most "
             f"{train // args.dp * args.dp}, or a shorter --seq-len")
    if idle:
        print(f"note: {args.dp * args.cp} of the {gpus} GPUs train, one rank each: --dp "
              f"{args.dp} x --cp {args.cp}, the most CP groups of {args.cp} GPUs that "
              f"--batch-size {args.batch_size} splits over evenly; {idle} stay idle (choose "
              "--dp, and a --batch-size that it divides, to use more)", flush=True)


def check_expert_parallel(args, load_data):
    """Refuse, before any rank starts, a --dp x --ep layout that cannot share out the experts,
    or a --batch-size or --seq-len that leaves a rank no step. --dp, when not given: torchrun's
    ranks / --ep; else the most EP groups of --ep GPUs that --batch-size splits over, at least 1."""
    idle = 0  # GPUs that the chosen --dp leaves without a rank
    if started_by_torchrun() and args.dp is None:
        if args.world_size % args.ep:
            fail(f"torchrun started {args.world_size} ranks, which do not make EP groups of "
                 f"--ep {args.ep}; start a multiple of {args.ep} processes in all, or change --ep")
        args.dp = args.world_size // args.ep
    elif started_by_torchrun() and args.dp * args.ep != args.world_size:
        fail(f"--dp {args.dp} x --ep {args.ep} = {args.dp * args.ep} ranks, but torchrun "
             f"started {args.world_size}; start dp x ep processes in all, or change --dp or --ep")
    elif args.dp is None:
        gpus = torch.cuda.device_count()
        args.dp = max((d for d in range(1, gpus // args.ep + 1)
                       if args.batch_size % (d * args.ep) == 0), default=1)
        if args.backend != "gloo" and args.ep <= gpus:  # else the ranks train on the CPU
            idle = gpus - args.dp * args.ep
    if args.experts % args.ep:
        fail(f"--experts {args.experts} does not share out over --ep {args.ep}: every rank of "
             f"an EP group holds experts / ep of them; use an --ep that divides {args.experts}")
    if not 1 <= args.top_k <= args.experts:
        fail(f"--top-k {args.top_k} must be from 1 to --experts {args.experts}: the experts "
             "each token goes to")
    ranks = args.dp * args.ep
    if args.batch_size % ranks:
        fail(f"--batch-size {args.batch_size}, the global batch, does not split over --dp x --ep "
             f"= {ranks} ranks (each reads its own sequences); use a multiple of {ranks}")
    if args.capacity_factor < 0 or args.balance_loss < 0:
        fail("--capacity-factor and --balance-loss must be 0 (off) or more")
    if args.dim % args.heads:
        fail(f"--heads {args.heads} does not divide --dim {args.dim}: each head takes "
             f"dim / heads of every token's features")
    try:
        train, validation = (len(part) for part in load_data(args.seq_len))
    except RuntimeError:  # unfold's: a text shorter than one sequence has no window to cut
        fail(f"--seq-len {args.seq_len} is longer than a text load_data cuts (not one sequence "
             f"of {args.seq_len + 1} characters); use a shorter --seq-len")
    # Each rank's sampler (drop_last) deals it train // ranks sequences, read in whole batches;
    # validation_loss gives each rank every ranks-th sequence: both at least one.
    if train < ranks or validation < ranks:
        fail(f"--seq-len {args.seq_len} cuts the texts into {train} training and {validation} "
             f"validation sequences: too few for {ranks} ranks, one each at least; use a "
             "shorter --seq-len")
    if train // ranks < args.batch_size // ranks:
        fail(f"--batch-size {args.batch_size} leaves no step: each of the {ranks} ranks reads "
             f"{train // ranks} of the {train} training sequences, in batches of "
             f"{args.batch_size // ranks}; use a --batch-size of at most {train // ranks * ranks}")
    if idle:
        print(f"note: {ranks} of the {idle + ranks} GPUs train, one rank each: --dp {args.dp} x "
              f"--ep {args.ep}, the most EP groups of {args.ep} that --batch-size "
              f"{args.batch_size} splits over evenly; {idle} stay idle (choose --dp, and a "
              "--batch-size that --dp x --ep divides, to use more)", flush=True)


def check_layout(args):
    """Refuse, before any rank starts, a --dp x --pp x --tp layout that cannot split the GPT.
    --dp, when not given: torchrun's ranks / (pp x tp); else the most pipelines of pp x tp GPUs
    for which dp x micro-batches divides --batch-size; 2 on the CPU if no pipeline fits."""
    ranks_per_pipeline = args.pp * args.tp
    idle = 0  # GPUs that the chosen --dp leaves without a rank
    if args.dp is None and started_by_torchrun():  # its ranks, in pipelines of pp x tp
        args.dp = max(1, args.world_size // ranks_per_pipeline)
    elif args.dp is None:  # the most pipelines of pp x tp GPUs that --batch-size splits over
        gpus = torch.cuda.device_count()
        most = gpus // ranks_per_pipeline
        args.dp = max((d for d in range(1, most + 1)
                       if args.batch_size % (d * args.microbatches) == 0), default=1)
        if not most:  # no pipeline fits on the GPUs: 2 pipelines on the CPU, with gloo
            args.dp = 2
        elif args.backend != "gloo":  # else the ranks train on the CPU
            idle = gpus - args.dp * ranks_per_pipeline
    world = args.dp * ranks_per_pipeline
    if started_by_torchrun() and world != args.world_size:
        fail(f"--dp {args.dp} x --pp {args.pp} x --tp {args.tp} = {world} ranks, but torchrun "
             f"started {args.world_size}; start dp x pp x tp processes in all, or change them")
    if args.dim % args.heads:
        fail(f"--heads {args.heads} does not divide --dim {args.dim}: each head takes "
             f"dim / heads of every token's features")
    if args.heads % args.tp:
        fail(f"--tp {args.tp} does not divide --heads {args.heads}: each rank of a TP group holds "
             f"heads / tp whole heads (and dim / tp = {args.dim / args.tp:g} of the width); "
             f"choose a --tp that divides {args.heads}")
    if args.layers % args.pp:
        fail(f"--layers {args.layers} do not split evenly over --pp {args.pp} stages; use a "
             f"multiple of {args.pp}, such as --layers {args.pp * max(1, args.layers // args.pp)}")
    if args.seq_len % args.tp:
        fail(f"--seq-len {args.seq_len} does not split over --tp {args.tp}: between its layers, "
             f"each rank of a TP group holds seq_len / tp of the tokens; use a multiple of "
             f"{args.tp}")
    per_dp = args.batch_size // args.dp
    if args.batch_size % args.dp or per_dp % args.microbatches:
        fail(f"--batch-size {args.batch_size}, the global batch, does not split over --dp "
             f"{args.dp} x --microbatches {args.microbatches}; use a multiple of "
             f"{args.dp * args.microbatches}")
    if args.schedule == "1f1b" and args.microbatches < args.pp:
        fail(f"--schedule 1f1b needs at least one micro-batch per stage (torch's Schedule1F1B "
             f"refuses fewer): --microbatches {args.microbatches} is fewer than --pp {args.pp}")
    if started_by_torchrun() and os.environ.get("RANK") == "0":  # one line, not one per rank
        note_groups_across_nodes(args.tp, args.dp * args.pp, int(os.environ["LOCAL_WORLD_SIZE"]))
    if idle:
        print(f"note: {world} of the {world + idle} GPUs train, one rank each: --dp {args.dp} x "
              f"--pp {args.pp} x --tp {args.tp}, the most pipelines of {ranks_per_pipeline} GPUs "
              f"for which --dp x --microbatches {args.microbatches} divides --batch-size "
              f"{args.batch_size}; {idle} stay{'s' if idle == 1 else ''} idle (choose --dp, and a "
              "--batch-size that dp x --microbatches divides, to use more)", flush=True)


# ---------------------------------------------------------------------------------------------
# Ranks: the port, ranks that fail, stall or lose each other
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


def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))  # port 0: the OS picks a free one, so two jobs never both take 29500
        return sock.getsockname()[1]


def start_ranks(fn, args, nprocs, preload=(), check_port=True):
    """mp.spawn(fn, args, nprocs), each rank forked from a server that has imported torch and
    preload once, not a fresh Python that imports them again (lesson 02's README: seconds a
    rank). On macOS and Windows, where Python's default is spawn, mp.spawn itself. check_port:
    False where the lesson checks MASTER_PORT itself (lesson 03: node 0's, in use on node 1)."""
    if check_port:
        check_master_port()  # one that is set must be free
    if sys.platform != "linux":
        return mp.spawn(fn, args=args, nprocs=nprocs)
    mp.set_forkserver_preload(["torch", "torch.distributed", *preload])
    return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


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
            if dist.is_initialized():
                # A peer that stopped with its own line (a full disk, say) or its traceback
                # makes the launcher stop this rank too: mp.spawn and torchrun end the other
                # ranks when one fails. A moment's wait lets that happen first, so that the
                # learner reads the cause and not this echo of it.
                time.sleep(1.5)
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
        leave_group(failed=code != 0)
    leave_process(code)  # the work ended well (0), or with its one line (1) or Ctrl-C (130)


def leave_group(failed):
    """Leave the process group: destroy it after work that ended well; after a failure, with
    NCCL, abort it instead. destroy_process_group waits for every NCCL collective this rank has
    started to finish (ProcessGroupNCCL::shutdown flushes them), and a collective that peers
    will never join, because they stopped or were lost, would hold this rank until NCCL's
    watchdog ends it at --timeout. An abort (ncclCommAbort) ends those collectives at once:
    torch.distributed's _abort_process_group, private and NCCL-only in torch 2.14. gloo's
    destroy does not wait for peers."""
    if not dist.is_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


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
    stopped, leaves at once with that exit code, skipping the interpreter's teardown.

    With torch 2.14, gloo's threads can outlive destroy_process_group, and Python tearing down
    the interpreter under them sometimes aborts the rank ("terminate called without an active
    exception", exit code -6): a job whose results are on disk fails, or a rank that printed its
    one line gets a second, wrong one from its launcher. On the course's 2-core CPU machine,
    `python tools/repro_teardown.py --crash --lesson 07_sharding --runs 12` (two torchrun nodes,
    rank 1 raising) saw 8 of 12 runs abort without this function and 0 of 12 with it; a rank
    that finishes normally aborted about once in 25 runs of lesson 07 (ZeRO-1). The cause, the
    upstream reports (pytorch/pytorch#190489, the abandoned pytorch/pytorch#179291) and every
    figure with its command: notes/teardown_abort.md in the course repository."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_lost_contact(error):
    """Whether error says that the other ranks did not come, went away or stalled: the store's
    and the network's errors, or gloo's whose text says so (in backward, autograd hands gloo's
    error on as a plain RuntimeError, hence the look at the text), or NCCL's where one reaches
    Python ("remote process exited"). Any other backend error, such as NCCL's "Duplicate GPU
    detected", is this rank's own and keeps its traceback.

    With NCCL, a peer that is lost or stalls in a collective usually raises nothing: NCCL's
    watchdog ends this rank at --timeout with SIGABRT (spawn_guard's line says so), as
    PyTorch's default TORCH_NCCL_ASYNC_ERROR_HANDLING asks. That default is kept on purpose:
    CUDA runs collectives asynchronously, and code that went on after a failed one could compute
    on corrupted data (init_process_group's docs). TORCH_NCCL_BLOCKING_WAIT=1 would raise
    instead, but only from a wait on the collective, it turns the watchdog's error handling off
    (ProcessGroupNCCL's constructor), and its blocking waits cost time on every step."""
    signs = ("connection reset by peer", "connection closed by peer", "connection refused",
             "timed out", "timeout", "broken pipe", "remote process exited", "network error")
    while error is not None:  # and what it was raised from: lesson 13's pipeline stage raises
        # "[Stage 0] failed to run forward" from gloo's error (pipelining/stage.py)
        if isinstance(error, (dist.DistStoreError, dist.DistNetworkError)) or (
                isinstance(error, RuntimeError) and any(s in str(error).lower() for s in signs)):
            return True
        error = error.__cause__
    return False


@contextlib.contextmanager
def spawn_guard(what, then=""):
    """Around mp.spawn: a rank that fails or dies becomes one line naming it (not a traceback
    of spawn's), and the job ends; spawn has already stopped the other ranks."""
    # spawn logs "Terminating process N via signal SIGTERM" for each rank it stops after one
    # failed (torch/multiprocessing/spawn.py); the line below says so once.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # start_ranks' fork server listens on a Unix socket, $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX,
    # and such a path holds at most 103 bytes on macOS (107 on Linux): under a longer TMPDIR,
    # Python fails with "AF_UNIX path too long" until python/cpython#132124's fix, which puts
    # the socket under /tmp instead; so does this launcher (tools/repro_forkserver_tmpdir.py).
    if len(tempfile.gettempdir()) + len("/pymp-XXXXXXXX/listener-XXXXXXXX") > 103 and \
            os.path.isdir("/tmp"):
        tempfile.tempdir = "/tmp"
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
        fail(f"{what} {error.error_index} {how_it_died(error.exit_code, what)}; the other "
             f"{what}s were stopped{then}")


def how_it_died(exit_code, what="rank"):
    """What a rank's exit code says about its end, for spawn_guard's line. A negative exit code
    is the signal that ended the process (multiprocessing's convention)."""
    try:
        name = signal.Signals(-exit_code).name if exit_code < 0 else None
    except ValueError:
        name = f"signal {-exit_code}"
    if name == "SIGABRT":
        # NCCL's watchdog aborts a rank whose collective waited longer than the group's timeout
        # (see is_lost_contact); its own lines above say "Watchdog caught collective operation
        # timeout".
        return (f"was aborted (SIGABRT): with NCCL, that is how a {what} ends whose collective "
                "waited longer than --timeout, because another rank stopped or stalled (its "
                "output says which; raise --timeout if it was only slow)")
    if name == "SIGKILL":
        return ("was killed (SIGKILL): by the out-of-memory killer (the kernel's log, dmesg, "
                "says so), by hand, or by a job scheduler")
    if name:
        return f"was ended by {name}"
    return f"died with exit code {exit_code}"


# ---------------------------------------------------------------------------------------------
# Nodes: node flags that cannot work, rank 0 out of reach, nodes that disagree
# ---------------------------------------------------------------------------------------------
NODE_FLAGS = ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port")


def check_nodes(args):
    """Before this node's ranks start, with MASTER_ADDR and MASTER_PORT set: node flags that
    cannot work, and a rank 0 that cannot be reached, each as one line instead of a hang."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if started_by_torchrun():
        # torchrun already numbered the nodes and processes; flags given to the script (argparse
        # also takes a flag's unambiguous start) would be ignored.
        given = [arg for arg in sys.argv[1:] if len(arg.split("=")[0]) > 2
                 and any(flag.startswith(arg.split("=")[0]) for flag in NODE_FLAGS)]
        if given:
            fail("under torchrun, give --nnodes, --node-rank, --nproc-per-node, --master-addr "
                 "and --master-port to torchrun, not to the script")
        # torchrun numbers the ranks node after node; with the same --nproc-per-node on every
        # node that is the lesson's formula, and the lesson relies on it.
        if args.node_rank * args.nproc_per_node + int(os.environ["LOCAL_RANK"]) != int(
                os.environ["RANK"]):
            fail(f"torchrun gave this process RANK={os.environ['RANK']}, not node_rank * "
                 "nproc_per_node + local_rank; start every node with the same --nproc-per-node")
    if args.node_rank < 0:
        fail(f"--node-rank must be 0 or more (got {args.node_rank})")
    if args.node_rank >= args.nnodes:
        fail(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}: node "
             f"ranks are 0 .. {args.nnodes - 1}, one per node")
    if not 0 < port < 65536:
        fail(f"--master-port must be a port number, 1 .. 65535 (got {port})")
    by_hand = not started_by_torchrun()  # else torchrun's rendezvous has met the nodes already
    if by_hand and args.node_rank == 0:
        # Rank 0 is about to listen here: the address must be this machine's, the port free.
        if not is_local_address(address):
            fail(f"--master-addr {address} is not an address of this machine, but node 0 runs "
                 "rank 0 and listens on it; give node 0 its own address (hostname -I)")
        if port_in_use(port):
            fail(f"port {port} is already in use on this machine; choose another with "
                 "--master-port, the same on every node")
    if args.backend == "gloo":
        check_gloo_address(address, args.nnodes)
    if by_hand and args.node_rank > 0 and not wait_for_master(address, port, args.timeout,
                                                               args.node_rank):
        fail(f"nothing answered at {address}:{port} within {args.timeout:g} s; start node 0 "
             "first, give every node node 0's address and port (--master-addr, --master-port) "
             "and check that a firewall lets that port through, or raise --timeout")


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


def wait_for_master(address, port, timeout, node_rank):
    """True once something listens at address:port, False if nothing does within timeout s."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, timeout)):
                return True
        except OSError:
            # Refused (node 0 has not started yet), unreachable or timed out: try again, since
            # nodes may be started in any order, until the deadline.
            if time.monotonic() >= deadline:
                return False
            if not said:
                print(f"node {node_rank}: waiting up to {timeout:g} s for rank 0 at "
                      f"{address}:{port} (start node 0 there)", flush=True)
                said = True
            time.sleep(0.5)


def check_backends_agree(backend, timeout):
    """Under torchrun on several nodes, before any process group: stop every rank with one line
    if the nodes chose different backends (--backend auto picks NCCL on a node with a GPU per
    rank, gloo on one without), since their ranks could never meet. The nodes compare their
    choices in torchrun's own store, which its agent hosts at MASTER_ADDR:MASTER_PORT (torch 2.14,
    unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: then nothing is compared here)."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        store = dist.PrefixStore(
            f"backend_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",  # keys per attempt
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout)))
        store.set(f"node_{os.environ['GROUP_RANK']}", backend)  # each rank of a node: the same
        chosen = [store.get(f"node_{node}").decode() for node in range(nodes)]
    except dist.DistError:  # the store unreachable, or a node's key not there in time
        fail(f"a node did not start its ranks within --timeout {timeout} s; start every node "
             "with the same --nnodes, --nproc-per-node, --master-addr and --master-port")
    if len(set(chosen)) > 1:
        table = ", ".join(f"node {node} {name}" for node, name in enumerate(chosen))
        fail(f"the nodes chose different backends ({table}): a node without a GPU per rank falls "
             "back to gloo; give every node as many GPUs as ranks, or --backend gloo on all")


def node_guard(rank, args):
    """rank_guard, with the advice that fits ranks spread over nodes."""
    advice = {"meet_fix": "start every node with the same --nnodes, --nproc-per-node, "
                          "--master-addr and --master-port, or raise --timeout"}
    if args.nnodes > 1:
        others = " or ".join(str(node) for node in range(args.nnodes) if node != args.node_rank)
        advice["lost_fix"] = (f"a peer node went away, or stalled longer than --timeout: the log "
                              f"of node {others} says why")
    return rank_guard(rank, args, **advice)


def rank_table(rank, local_rank, args):
    """Every rank's numbers (global, local, node, host), gathered from all of them in rank
    order, for rank 0 to print what the ranks report rather than what the formula promises.

    Each node was started by its own command, so their training flags are compared too: a node
    started with other flags would run other steps, and hang or crash its peers."""
    mine = {"rank": rank, "local_rank": local_rank, "node_rank": args.node_rank,
            "host": socket.gethostname()}
    settings = {"epochs": args.epochs, "batch-size": args.batch_size, "lr": args.lr,
                "seed": args.seed, "save-every": args.save_every, "backend": args.backend}
    gathered = [None] * dist.get_world_size()
    # With NCCL the pickled objects travel on torch.cuda.current_device(), which is why each
    # rank must have called set_device first (all_gather_object's documentation).
    dist.all_gather_object(gathered, (mine, settings))
    for other, other_settings in gathered:
        for flag, value in other_settings.items():
            if value != gathered[0][1][flag]:
                fail(f"node {other['node_rank']} was started with --{flag} {value} but node 0 "
                     f"with --{flag} {gathered[0][1][flag]}; give every node the same flags")
    return [entry for entry, _ in gathered]


# ---------------------------------------------------------------------------------------------
# Saving: a save that fails (a full disk, no permission, a read-only filesystem)
# ---------------------------------------------------------------------------------------------
AGAIN = "then run the same command again"


WRITE_FIXES = {
    errno.ENOSPC: f"free some space there, {AGAIN}",
    errno.EDQUOT: f"free some space there, {AGAIN}",
    errno.EROFS: f"make that filesystem writable, {AGAIN} (or choose another --out-dir)",
    errno.EACCES: f"make that folder writable, {AGAIN} (or choose another --out-dir)",
    errno.EPERM: f"make that folder writable, {AGAIN} (or choose another --out-dir)",
}


def os_error_in(error):
    """The OSError that error is, or was raised from; else None. (torch.save into a file that
    takes no more bytes raises a RuntimeError of its own, and the file's OSError follows.)"""
    for _ in range(10):  # a chain of causes, followed a few links at most
        if error is None or isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
    return None


def cannot_write(path, error, intact=""):
    """The one line for a write into path that failed with error, an OSError: the reason (the
    system's words), what is intact, and what to do."""
    fix = WRITE_FIXES.get(error.errno, f"fix that, {AGAIN}")
    return f"cannot write {path} ({error.strerror or error}); {intact}{fix}"


@contextlib.contextmanager
def save_or_fail(path, tmp_path):
    """Around the writing of path by way of tmp_path, a file beside it renamed over it last: a
    write that fails stops with one line (cannot_write), and what was written of tmp_path is
    removed. The file at path, if there was one, is intact: only the rename replaces it."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        cause = os_error_in(error)
        if cause is None:
            raise  # not a write that failed: a bug, with its traceback
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        kept = os.path.exists(path)
        fail(cannot_write(path, cause, f"the previous {os.path.basename(path)} is intact; "
                                       if kept else ""))


# ---------------------------------------------------------------------------------------------
# Resuming: a snapshot that cannot continue this run, or that some rank cannot see; the store
# torchrun's restarts need
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
            say_first(stop.code)
            answer = [("stop", None)]
    dist.broadcast_object_list(answer, src=0)
    verdict, value = answer[0]
    if verdict == "stop":
        sys.exit(1)
    return value


def say_first(line):
    """Rank 0 prints its one line before it tells the other ranks to stop: a launcher stops
    every rank as soon as one has ended, and a line not yet printed would be lost."""
    if isinstance(line, str):
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def barrier_after_save(rank):
    """Around a save that rank 0 alone makes, entered by every rank. At its end every rank
    waits until rank 0 is done, as at dist.barrier(), and learns how it went: if rank 0 could
    not write (its one line, from save_or_fail), every rank stops there, none left waiting for
    rank 0 until --timeout, or saying that it lost contact."""
    stopped = None
    try:
        yield
    except SystemExit as stop:
        if rank != 0:
            raise
        stopped = stop
    stop_together(rank, stopped)


def stop_together(rank, stop):
    """A barrier that tells every rank whether rank 0 stopped (stop: its SystemExit, else None):
    if it did, rank 0 prints its line, and then every rank stops, with exit code 1."""
    if stop is not None:
        say_first(stop.code)
    stopping = [stop is not None]
    dist.broadcast_object_list(stopping, src=0)
    if stopping[0]:
        sys.exit(1)


def snapshot_to_resume(rank, path, args, make_model):
    """The snapshot at path, as a file in memory, for every rank to resume from; or None to
    start afresh. Rank 0 alone checks it (check_snapshot) and hands its answer to every rank;
    every rank then shows that it sees that very file. When another number of ranks resumes
    it, rank 0 says what that changes."""
    expected = decided_by_rank_0(rank, check_snapshot, path, args, make_model)
    if expected is None:
        return None
    snapshot_file = read_same_snapshot(path, expected)
    before = expected["world_size"]
    if rank == 0 and before != args.world_size and expected["epochs_completed"] < args.epochs:
        # The weights and the optimizer's state do not depend on the number of ranks; the
        # global batch does (--batch-size is per rank), and with it every step from here on.
        print(f"note: the snapshot was written by {before} ranks and {args.world_size} resume "
              f"it: the global batch goes from {args.batch_size * before} to "
              f"{args.batch_size * args.world_size}", flush=True)
    return snapshot_file


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
# Sharded checkpoints (DCP): a folder that cannot continue this run, a save that fails, ranks
# that disagree on what to resume
# ---------------------------------------------------------------------------------------------
def check_checkpoint(path, args):
    """Stop with one line if the checkpoint in path cannot go on as this run asks."""
    import torch.distributed.checkpoint as dcp  # lesson 07 alone needs it

    check_checksums(path)  # every file whole, as its save wrote it, before any is read
    try:
        # DCP's .metadata is a pickle, read with pickle.load (not weights_only): resume only
        # from checkpoints you or your job wrote. The shards themselves load weights_only.
        metadata = dcp.FileSystemReader(path).read_metadata()
        with open(os.path.join(path, "progress.json")) as f:
            done = json.load(f)["epochs_completed"]
        held = checkpoint_sizes(metadata.state_dict_metadata)
    except Exception as error:  # a damaged folder raises one of several types
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        fail(f"{path} cannot be loaded ({type(error).__name__}: {reason[:150]}); it is damaged "
             "or not a checkpoint of this lesson: delete it or choose another --out-dir")
    for flag, value in held.items():
        asked = getattr(args, flag.removeprefix("--").replace("-", "_"), 1)  # --layers: 1
        if value != asked:
            fail(f"{path} holds a model with {flag} {value}, not {asked}; resume with "
                 f"{flag} {value}, or delete it or choose another --out-dir")
    if done > args.epochs:
        fail(f"{path} has {done} epochs done, more than --epochs {args.epochs}; ask for at "
             f"least {done} or choose another --out-dir")


CHECKSUMS = "checksums.json"  # the last file a save writes into its folder (record_checksums)


def file_sha256(file):
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_checksums(path):
    """Write the size and SHA-256 of every file of the checkpoint folder path into its
    checksums.json, the folder's last file. DCP's load reads each tensor from the file, offset
    and length that .metadata names, and checks no checksum: a shard overwritten with other
    bytes of the same size (another epoch's shard, a disk's error) would load without a word."""
    sums = {name: [os.path.getsize(os.path.join(path, name)), file_sha256(os.path.join(path, name))]
            for name in sorted(os.listdir(path)) if name != CHECKSUMS}
    tmp_path = os.path.join(path, f"{CHECKSUMS}.tmp")
    with open(tmp_path, "w") as f:
        json.dump(sums, f, indent=1)
    os.replace(tmp_path, os.path.join(path, CHECKSUMS))  # whole or not at all


def check_checksums(path):
    """Stop with one line unless every file of the checkpoint folder path holds the bytes that
    record_checksums found in it when its save ended."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            sums = json.load(f)
    except FileNotFoundError:
        fail(f"{path} is damaged: it has no {CHECKSUMS}, which its save writes last, so the "
             f"save was cut short; {damaged_fix(path)}")
    except ValueError:
        fail(f"{path} is damaged: its {CHECKSUMS} is not JSON; {damaged_fix(path)}")
    for name, (size, sha256) in sorted(sums.items()):
        file = os.path.join(path, name)
        has = os.path.getsize(file) if os.path.isfile(file) else None
        if has is None:
            what = "is missing"
        elif has != size:
            what = f"is {'cut short' if has < size else 'longer'} ({has} of its {size} bytes)"
        elif file_sha256(file) != sha256:
            what = f"holds other bytes than its save wrote (its SHA-256 is not {CHECKSUMS}'s)"
        else:
            continue
        fail(f"{path} is damaged: its file {name} {what}; {damaged_fix(path)}")


def damaged_fix(path):
    """What to do about the damaged checkpoint folder path: resume from the finished one beside
    it, if there is one."""
    older = checkpoints_beside(path)
    fix = f"delete {path} to resume from {older[-1]}" if older else f"delete {path} to start afresh"
    return f"{fix}, or choose another --out-dir"


def checkpoint_sizes(tensors):
    """{flag: value} of the model a checkpoint holds, read from its tensors' sizes: the wine
    MLP's --hidden and --layers (lessons 07 to 10), or the GPT's --dim, --seq-len and --layers
    (lessons 11 to 13), and --experts (lesson 12)."""
    if "model.tokens.weight" in tensors:
        sizes = {"--dim": tensors["model.tokens.weight"].size[1],
                 "--seq-len": tensors["model.positions.weight"].size[0],
                 "--layers": sum(key.startswith("model.blocks.") and key.endswith(".norm1.weight")
                                 for key in tensors)}
        if "model.blocks.0.moe.router.weight" in tensors:
            sizes["--experts"] = tensors["model.blocks.0.moe.router.weight"].size[0]
        return sizes
    return {"--hidden": tensors["model.fc1.weight"].size[0],
            "--layers": 1 + sum(key.startswith("model.hidden.") and key.endswith(".weight")
                                for key in tensors)}


def checkpoints_beside(path):
    """The finished checkpoint folders beside the folder path (each with its checksums.json,
    which its save writes last), oldest first; path itself is not one of them."""
    parent = os.path.dirname(path)
    names = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    return [os.path.join(parent, name) for name in names if name != os.path.basename(path)
            and os.path.isfile(os.path.join(parent, name, CHECKSUMS))]


def checkpoint_not_written(path, error, rank=None):
    """The one line for a checkpoint folder path not written: error (an OSError) of the rank
    whose write failed, the checkpoint that is intact, and what to do."""
    older = checkpoints_beside(path)
    intact = f"the previous checkpoint, {os.path.basename(older[-1])}, is intact; " if older else ""
    where = f"{error.filename or path}" + (f" on rank {rank}" if rank is not None else "")
    return f"error: {cannot_write(where, error, intact)}"


@contextlib.contextmanager
def sharded_save_or_fail(rank, path):
    """Around lesson 07's save of a checkpoint into the folder path, entered by every rank:
    rank 0 makes the folder, every rank calls the barrier this yields (which also tells every
    rank whether rank 0 could write), and then every rank writes its shards with dcp.save.

    A write that fails, rank 0's before the barrier or any rank's in dcp.save (which hands
    each rank's failure to every rank, in a CheckpointException), ends the job with one line
    from rank 0 (checkpoint_not_written). The unfinished folder is removed, and every rank
    stops: none waits for another until --timeout, or says that it lost contact. A save that
    ends well ends with checksums.json, each file's SHA-256 (record_checksums), which a resume
    checks (check_checkpoint)."""
    from torch.distributed.checkpoint import CheckpointException

    past_barrier = []

    def barrier():
        past_barrier.append(True)
        stop_together(rank, None)

    try:
        yield barrier
    except OSError as error:  # rank 0, making the folder, while the others wait at the barrier
        if rank != 0 or past_barrier:
            raise
        shutil.rmtree(path, ignore_errors=True)
        stop_together(rank, SystemExit(checkpoint_not_written(path, error)))
    except CheckpointException as error:  # every rank, each with every rank's failures
        failed = [(r, os_error_in(exc)) for r, (exc, _) in sorted(error.failures.items())]
        failed = [(r, exc) for r, exc in failed if exc is not None]
        if not failed:
            raise  # not a write that failed: a bug, with its traceback
        if rank == 0:  # once every rank is done with the folder: DCP gathered their results
            shutil.rmtree(path, ignore_errors=True)
            say_first(checkpoint_not_written(path, failed[0][1], failed[0][0]))
        dist.barrier()  # the others stop once rank 0 has said why
        sys.exit(1)
    # dcp.save returns on rank 0 once every rank's shards and then .metadata are written: rank
    # 0 records their checksums, and every rank waits for it, so that a save is over, for all,
    # only once its folder is whole.
    stopped = None
    if rank == 0:
        try:
            record_checksums(path)
        except OSError as error:
            shutil.rmtree(path, ignore_errors=True)
            stopped = SystemExit(checkpoint_not_written(path, error))
    stop_together(rank, stopped)


def agree_on_checkpoint(rank, checkpoint_dir, latest_checkpoint):
    """The checkpoint to resume from (None: start afresh), chosen by rank 0 for every rank,
    once every rank has shown that it sees the folder rank 0 writes to. Else one line from
    rank 0, and the job stops before it trains.

    Every rank writes its own shards into that folder and reads them all back on resume. On
    one machine it is one folder; across nodes it is one only on a filesystem they share. On
    disks of their own, each node would keep its ranks' shards and rank 0 alone .metadata: a
    checkpoint that no node could load, found only at the resume."""
    note = os.path.join(checkpoint_dir, ".rank0")

    def choose():  # rank 0: [checkpoint or None, what it wrote into the note]
        written = f"{socket.gethostname()} {time.time_ns()}"
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
            with open(note, "w") as f:
                f.write(written)
        except OSError as error:  # a full disk, a read-only folder: nothing can be saved there
            with contextlib.suppress(OSError):
                os.remove(note)
            latest = latest_checkpoint(checkpoint_dir)
            fail(cannot_write(checkpoint_dir, error, f"the checkpoint {os.path.basename(latest)} "
                                                     "in it is intact; " if latest else ""))
        return [latest_checkpoint(checkpoint_dir), written]

    choice = decided_by_rank_0(rank, choose)  # after the write: the others look only now
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
