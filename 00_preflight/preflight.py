"""Lesson 00: preflight. Run it first: it checks what this machine can run, in a few seconds.

It looks at Python, torch, the CPU cores, CUDA, NCCL and gloo, a free port, torchrun and Slurm;
then it starts two processes with torch.multiprocessing, as lesson 02 does, has them form a gloo
process group and all_reduce a tensor (and an NCCL group on the GPUs, where there are any). It
ends with the exact command of every lesson this machine can run, and why it cannot run the
others. Every check is bounded by a timeout, so it never hangs. It exits with status 1 and one
line starting "error:" that names the fix when lesson 02 cannot run here at all.

Run it from the repository root:
    python 00_preflight/preflight.py                     # the checks, then the commands
    python 00_preflight/preflight.py --json              # the same, as JSON
    python 00_preflight/preflight.py --master-port 29500 # test the port you mean to use
    python 00_preflight/preflight.py --timeout 120       # a very slow machine: wait longer
"""

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: this file is 00_preflight/...
MIN_PYTHON = (3, 10)
REQUIRED_TORCH = "2.14"  # requirements.txt pins torch>=2.14,<2.15
MULTI_NODE_PORT = 29500  # lesson 03's default --master-port with several nodes
START_SECONDS = 60  # how long two fresh processes may take to import torch and report back
# Where 03_multi_node/slurm/local_cluster.sh keeps its slurm.conf, unless DDP_SLURM_DIR says else.
LOCAL_SLURM_CONF = os.path.join(os.environ.get("DDP_SLURM_DIR", "/tmp/ddp-slurm"), "slurm.conf")
# What that script needs, beyond root: Slurm's daemons and clients, munge, and iproute2.
LOCAL_CLUSTER_TOOLS = ("slurmctld", "slurmd", "munged", "munge", "sbatch", "srun", "sinfo",
                       "squeue", "scontrol", "ip", "nsenter", "unshare")
WHERE = {"cpu": "CPU", "gpu": "GPU", "slurm": "Slurm"}


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
class Report:
    """The checks' results, printed as they come (or kept for --json)."""

    def __init__(self, quiet):
        self.quiet = quiet
        self.checks = []

    def add(self, status, name, detail):
        self.checks.append({"name": name, "status": status, "detail": detail})
        if not self.quiet:
            print(f"  {status:4}  {name:12} {detail}", flush=True)
        return status == "OK"


def bounded(function, seconds):
    """function() in a thread: its result, or TimeoutError if it has not returned in time.

    For the calls that can stall on a broken driver (CUDA) where a subprocess is not an option;
    the thread is a daemon, so a stuck call cannot keep this program from exiting."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function()
        except Exception as error:  # reported to the caller, not lost in the thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run_command(argv, seconds=5):
    """(exit code, output) of a short command; exit code None if it did not finish in time."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return None, ""
    except OSError as error:
        return 127, str(error)
    return result.returncode, (result.stdout + result.stderr).strip()


def port_in_use(address, port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR, as the rendezvous server itself sets it: a port that only lingers in
        # TIME_WAIT after an earlier run is free; one that a live server listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return True
    return False


def find_free_port(address):
    # Port 0 asks the operating system for any free port, as lesson 02 does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def is_local_address(address):
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((socket.gethostbyname(address), 0))
    except OSError:
        return False
    return True


def first_line(error):
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


# ---------------------------------------------------------------------------------------------
# The process-group check: what each of the two processes runs
# ---------------------------------------------------------------------------------------------
def group_worker(rank, world_size, backend, timeout, results):
    """Join a group of world_size processes, all_reduce [rank + 1], report on the queue."""
    try:
        import torch
        import torch.distributed as dist

        device = torch.device("cpu")
        if backend == "nccl":
            # One GPU per process, chosen before anything touches CUDA, as the lessons do.
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        # MASTER_ADDR and MASTER_PORT come from the environment, set by the parent process.
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout),
                                device_id=device if backend == "nccl" else None)
        tensor = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(tensor)  # the sum 1 + 2 + ... + world_size, on every rank
        results.put((rank, "ok", tensor.item()))
        dist.destroy_process_group()
    except Exception as error:  # the parent reports it; a traceback here would only add noise
        results.put((rank, "error", first_line(error)))
    # Leave at once: gloo's threads can abort a process that tears them down at exit (seen with
    # torch 2.14 in lesson 02), which would turn a passed check into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_group(backend, world_size, timeout):
    """Start world_size processes as lesson 02 does; (True, detail) or (False, reason)."""
    import torch.multiprocessing as mp

    # As lesson 02's start_ranks: forked from a server that has imported torch once on Linux,
    # spawned on macOS and Windows (Python's default there).
    method = "forkserver" if sys.platform == "linux" else "spawn"
    mp.set_forkserver_preload(["torch", "torch.distributed"])
    results = mp.get_context(method).SimpleQueue()
    start = time.monotonic()
    # join=False: this process keeps the clock. A process that never reports is killed at the
    # deadline instead of being waited for forever, as plain mp.spawn would.
    context = mp.start_processes(group_worker, args=(world_size, backend, timeout, results),
                                 nprocs=world_size, join=False, start_method=method)
    deadline = start + START_SECONDS + timeout
    reports, died = {}, None
    try:
        while len(reports) < world_size and time.monotonic() < deadline:
            while not results.empty():
                rank, status, value = results.get()
                reports[rank] = (status, value)
            if any(status == "error" for status, _ in reports.values()):
                break  # one rank failed: the others would only wait for it until the timeout
            try:
                context.join(timeout=0.2)
            except mp.ProcessExitedException as error:
                died = f"rank {error.error_index} died with exit code {error.exit_code}"
                break
            except mp.ProcessException as error:
                died = f"rank {error.error_index} failed: {first_line(error)}"
                break
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    seconds = time.monotonic() - start
    errors = [f"rank {rank}: {value}" for rank, (status, value) in sorted(reports.items())
              if status == "error"]
    if errors:
        return False, "; ".join(errors)
    if died:
        return False, died
    if len(reports) < world_size:
        missing = sorted(set(range(world_size)) - set(reports))
        return False, (f"rank(s) {missing} did not report within {seconds:.0f} s "
                       "(still importing torch, or stuck joining the group)")
    expected = world_size * (world_size + 1) / 2
    values = [value for _, value in reports.values()]
    if any(value != expected for value in values):
        return False, f"all_reduce gave {values}, expected {expected:g} on every rank"
    return True, (f"{world_size} processes met at {os.environ['MASTER_ADDR']}:"
                  f"{os.environ['MASTER_PORT']}; all_reduce gave {expected:g} on every rank "
                  f"({seconds:.1f} s)")


def fix_for_group_error(reason, address, port):
    """The sentence that names the fix for a failed gloo group, from the error it gave."""
    if "EADDRINUSE" in reason or "address already in use" in reason.lower():
        return (f"port {port} is already in use on this machine; choose another with "
                "--master-port, or unset MASTER_PORT (the lessons then pick a free port)")
    if "Unable to find address for" in reason:
        return (f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')} is not a network "
                "interface of this machine (gloo takes one name, not NCCL's ^lo syntax); unset "
                "it, or set it to an interface that `ip addr` (ipconfig on Windows) lists")
    if "Unable to resolve hostname" in reason or "resolve" in reason.lower():
        return ("this machine's name does not resolve to an address; set GLOO_SOCKET_IFNAME=lo "
                "(lo0 on macOS) for runs on this machine")
    if "did not report" in reason or "died" in reason:
        return ("the processes did not start or finish; run again with --timeout 120 on a slow "
                "or busy machine, and see TROUBLESHOOTING.md")
    return (f"the processes could not meet at {address}:{port}; check that no firewall blocks "
            "connections on this machine, raise --timeout, and see TROUBLESHOOTING.md")


# ---------------------------------------------------------------------------------------------
# What this machine can run
# ---------------------------------------------------------------------------------------------
def python_command():
    """'python' when that name on PATH is this interpreter, else this interpreter's path."""
    on_path = shutil.which("python")
    here = Path(sys.executable)
    if on_path and Path(on_path).parent == here.parent:
        return "python"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def torchrun_command(python):
    on_path = shutil.which("torchrun")
    if on_path and Path(on_path).parent == Path(sys.executable).parent:
        return "torchrun"
    return f"{python} -m torch.distributed.run"  # the same program, always installed with torch


def plan(facts):
    """(can, cannot): the lessons this machine can run, with commands, and the others, with why.

    can: dicts with lesson, where ("cpu", "gpu" or "slurm"), commands, note.
    cannot: dicts with lesson, where, reason."""
    python, torchrun = facts["python"], facts["torchrun"]
    gpus, cpu_ok, gpu_ok = facts["gpus"], facts["gloo_ok"], facts["nccl_ok"]
    # On a GPU machine the lessons pick NCCL and one process per GPU by default: the CPU
    # commands then say gloo, and two processes.
    on_cpu = " --backend gloo" if gpus else ""
    per_node = " --nproc-per-node 2" if gpus else ""
    two_ranks = " --world-size 2" if gpus else ""
    port = "" if facts["multi_node_port_free"] else f" --master-port {facts['spare_port']}"
    wanted = [
        ("01_single_gpu", "cpu", [f"{python} 01_single_gpu/train.py"
                                  + (" --device cpu" if gpus else "")], "one process", True),
        ("02_multi_gpu_spawn", "cpu",
         [f"{python} 02_multi_gpu_spawn/train.py --world-size 2{on_cpu}"],
         "2 ranks over gloo", cpu_ok),
        ("03_multi_node", "cpu",
         [f"{python} 03_multi_node/train.py --nnodes 2 --node-rank 0{per_node}{port}{on_cpu}",
          f"{python} 03_multi_node/train.py --nnodes 2 --node-rank 1{per_node}{port}{on_cpu}"],
         "two nodes on this machine, each command in its own terminal", cpu_ok),
        ("03_multi_node", "cpu",
         [f"{torchrun} --standalone --nproc-per-node 2 03_multi_node/train.py{on_cpu}"],
         "the same job started by torchrun", cpu_ok),
        ("04_checkpointing", "cpu",
         [f"{python} 04_checkpointing/train.py --save-every 2 --crash-at-epoch 3{two_ranks}"
          f"{on_cpu}",
          f"{python} 04_checkpointing/train.py --save-every 2{two_ranks}{on_cpu}"],
         "the first run stops at epoch 3; the second resumes from its snapshot", cpu_ok),
        ("05_model_parallel_ddp", "cpu",
         [f"{python} 05_model_parallel_ddp/train.py --world-size 2{on_cpu}"],
         "2 ranks, both stages of each on the CPU", cpu_ok),
        ("06_ddp_in_practice", "cpu",
         [f"{python} 06_ddp_in_practice/train.py --world-size 2 --precision bf16 "
          f"--batch-size 8 --accumulate 4 --clip-grad-norm 1{on_cpu}"],
         "2 ranks, bf16, 4 micro-batches per step, clipping", cpu_ok),
        ("07_sharding", "cpu",
         [f"{python} 07_sharding/train.py --world-size 2{on_cpu}"],
         "2 ranks, FSDP: each holds half of every tensor", cpu_ok),
        ("08_ddp_from_scratch", "cpu",
         [f"{python} 08_ddp_from_scratch/train.py --world-size 2{on_cpu}"],
         "2 ranks, the gradients averaged by hand in buckets, as DDP does", cpu_ok),
        ("09_tensor_parallel", "cpu",
         [f"{python} 09_tensor_parallel/train.py --tp 2 --dp 1{on_cpu}"],
         "2 ranks, each layer split over both (tensor parallelism)", cpu_ok),
        ("10_pipeline_parallel", "cpu",
         [f"{python} 10_pipeline_parallel/train.py --stages 2 --dp 1{on_cpu}"],
         "2 ranks, a stage of the layers each (a pipeline, 1F1B)", cpu_ok),
        ("11_context_parallel", "cpu",
         [f"{python} 11_context_parallel/train.py --cp 2 --dp 1{on_cpu}"],
         "2 ranks share each sequence (ring attention)", cpu_ok),
        ("12_expert_parallel", "cpu",
         [f"{python} 12_expert_parallel/train.py --ep 2 --dp 1{on_cpu}"],
         "2 ranks, 2 experts each, the tokens sent to them by all-to-all", cpu_ok),
        ("13_capstone", "cpu",
         [f"{python} 13_capstone/train.py --dp 2 --pp 2 --tp 2{on_cpu}"],
         "8 ranks: 2 pipelines of 2 stages, each stage split over 2 ranks, FSDP across", cpu_ok),
        # Lesson 14 starts no ranks: PyTorch's fake process group, which needs no gloo, no GPU.
        ("14_planning", "cpu",
         [f"{python} 14_planning/plan.py --model tiny --gpus 8 --layout 2,2,2 --batch-size 16 "
          "--microbatches 2"],
         "no ranks started: lesson 13's layout built and measured on fake tensors", True),
    ]
    if gpus:
        pairs = gpus // 2
        wanted += [
            ("01_single_gpu", "gpu", [f"{python} 01_single_gpu/train.py"], "cuda:0", True),
            ("02_multi_gpu_spawn", "gpu", [f"{python} 02_multi_gpu_spawn/train.py"],
             f"{gpus} rank(s), one per GPU, NCCL", gpu_ok),
            ("03_multi_node", "gpu",
             [f"{torchrun} --standalone --nproc-per-node {gpus} 03_multi_node/train.py"],
             f"{gpus} rank(s) started by torchrun, NCCL", gpu_ok),
            ("04_checkpointing", "gpu", [f"{python} 04_checkpointing/train.py"],
             "one rank per GPU, NCCL", gpu_ok),
            ("05_model_parallel_ddp", "gpu", [f"{python} 05_model_parallel_ddp/train.py"],
             f"{pairs} rank(s) over GPU pairs" if pairs else "one rank, both stages on cuda:0",
             gpu_ok),
            ("06_ddp_in_practice", "gpu",
             [f"{python} 06_ddp_in_practice/train.py --precision bf16 --clip-grad-norm 1"],
             "one rank per GPU, NCCL, bf16 (--precision fp16 on GPUs older than Ampere)",
             gpu_ok),
            ("07_sharding", "gpu", [f"{python} 07_sharding/train.py"],
             f"{gpus} rank(s), one per GPU, FSDP over NCCL", gpu_ok),
            ("08_ddp_from_scratch", "gpu", [f"{python} 08_ddp_from_scratch/train.py"],
             f"{gpus} rank(s), one per GPU, NCCL, the gradients averaged by hand", gpu_ok),
            ("09_tensor_parallel", "gpu",
             [f"{python} 09_tensor_parallel/train.py" + ("" if pairs else " --tp 1")],
             f"{pairs} TP group(s) of 2 GPUs, FSDP across them, NCCL" if pairs
             else "one rank on cuda:0, nothing to split", gpu_ok),
        ]
        if pairs:  # a stage, a CP or an EP rank per GPU: one GPU has nothing to split them over
            wanted += [
                ("10_pipeline_parallel", "gpu", [f"{python} 10_pipeline_parallel/train.py"],
                 f"{pairs} pipeline(s) of 2 stages, a GPU each, NCCL", gpu_ok),
                ("11_context_parallel", "gpu", [f"{python} 11_context_parallel/train.py"],
                 f"{pairs} CP group(s) of 2 GPUs, NCCL", gpu_ok),
                ("12_expert_parallel", "gpu", [f"{python} 12_expert_parallel/train.py"],
                 f"{pairs} EP group(s) of 2 GPUs, NCCL", gpu_ok),
            ]
        if gpus >= 4:  # a rank per GPU of --pp 2 x --tp 2
            wanted += [("13_capstone", "gpu", [f"{python} 13_capstone/train.py"],
                        f"{gpus // 4} pipeline(s) of 2 stages of 2 TP GPUs, FSDP across, NCCL",
                        gpu_ok)]
    can, cannot = [], []
    for lesson, where, commands, note, runnable in wanted:
        if any(entry["lesson"] == lesson and entry["where"] == where for entry in cannot):
            continue  # one reason per lesson and place is enough
        program = "plan.py" if lesson == "14_planning" else "train.py"  # 14 trains nothing
        if not (ROOT / lesson / program).is_file():
            cannot.append({"lesson": lesson, "where": where,
                           "reason": f"{lesson}/{program} is not in this copy of the repository"})
        elif not runnable:
            cannot.append({"lesson": lesson, "where": where,
                           "reason": facts["nccl_why"] if where == "gpu" else facts["gloo_why"]})
        else:
            can.append({"lesson": lesson, "where": where, "commands": commands, "note": note})
    if not gpus:
        cannot.append({"lesson": "every lesson", "where": "gpu", "reason": facts["gpu_why"]})
    elif gpus == 1:  # lessons 10 to 12 split the work over 2 ranks; NCCL needs a GPU each
        for lesson, each in (("10_pipeline_parallel", "a stage"),
                             ("11_context_parallel", "half of each sequence"),
                             ("12_expert_parallel", "half of the experts")):
            if (ROOT / lesson / "train.py").is_file():
                cannot.append({"lesson": lesson, "where": "gpu", "reason":
                               f"one GPU, and it needs 2, {each} on each; its CPU command "
                               "above runs on gloo"})
    if 0 < gpus < 4 and gpu_ok and (ROOT / "13_capstone" / "train.py").is_file():
        cannot.append({"lesson": "13_capstone", "where": "gpu", "reason":
                       f"{gpus} GPU(s), and it needs 4, one per rank of --pp 2 x --tp 2; its "
                       "CPU command above runs on gloo"})

    slurm = "03_multi_node/slurm"
    if not facts["sbatch"]:
        cannot.append({"lesson": "03_multi_node", "where": "slurm",
                       "reason": "no sbatch on PATH (Slurm is not installed here); on Debian or "
                                 "Ubuntu, apt-get install slurm-wlm munge"})
    elif not (ROOT / slurm / "train.sbatch").is_file():
        cannot.append({"lesson": "03_multi_node", "where": "slurm",
                       "reason": f"{slurm}/train.sbatch is not in this copy of the repository"})
    elif facts["slurm_answers"]:
        can.append({"lesson": "03_multi_node", "where": "slurm", "note": facts["slurm_note"],
                    "commands": [f"sbatch {slurm}/train.sbatch", "squeue"]})
    elif facts["local_cluster_missing"]:
        cannot.append({"lesson": "03_multi_node", "where": "slurm",
                       "reason": f"{facts['slurm_note']}, and the local two-node cluster needs "
                                 f"{facts['local_cluster_missing']}"})
    else:
        # Lesson 03's local cluster: two slurmd in network namespaces on this machine. Its
        # daemons and jobs run as root, and the job finds torchrun on the PATH it is given.
        can.append({"lesson": "03_multi_node", "where": "slurm",
                    "note": "no Slurm cluster answers, so start lesson 03's local two-node one, "
                            "in a root shell (sudo -i) with the virtual environment active",
                    "commands": [f"bash {slurm}/local_cluster.sh start",
                                 f"export SLURM_CONF={LOCAL_SLURM_CONF}",
                                 f"sbatch {slurm}/train.sbatch --epochs 5 --out-dir runs/slurm",
                                 "squeue",
                                 f"bash {slurm}/local_cluster.sh stop"]})
    return can, cannot


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(args):
    report = Report(quiet=args.json)
    if not args.json:
        print(f"Preflight for the DDP lessons on {socket.gethostname()} "
              f"({platform.system()} {platform.machine()})", flush=True)
    python = python_command()
    version = ".".join(map(str, sys.version_info[:3]))
    python_ok = report.add("OK" if sys.version_info >= MIN_PYTHON else "FAIL", "python",
                           f"{version} at {sys.executable}"
                           + ("" if sys.version_info >= MIN_PYTHON else
                              "; the lessons need Python 3.10 or newer"))
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:
        report.add("FAIL", "torch", f"cannot import torch ({first_line(error)})")
        return finish(args, report, [], [], "torch is not installed for this Python "
                      f"({sys.executable}); activate the lessons' virtual environment, or run "
                      "pip install -r requirements.txt")
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    note = "" if torch.__version__.startswith(REQUIRED_TORCH) else (
        f"; requirements.txt asks for {REQUIRED_TORCH}, the version the lessons are tested with")
    report.add("OK", "torch", f"{torch.__version__} ({build}){note}")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    report.add("OK", "cpu", f"{cores} core(s) usable; CPU ranks share them"
               + (" (one core: ranks take turns, runs are slower)" if cores == 1 else ""))

    # CUDA: how many GPUs torch sees, and, if none, why not.
    try:
        gpus = bounded(torch.cuda.device_count, 30)
        names = bounded(lambda: [torch.cuda.get_device_name(i) for i in range(gpus)], 30)
        cuda_error = None
    except Exception as error:
        gpus, names, cuda_error = 0, [], first_line(error)
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda_error:
        gpu_why = f"asking torch for GPUs failed ({cuda_error})"
        report.add("FAIL", "cuda", gpu_why)
    elif gpus:
        gpu_why = ""
        report.add("OK", "cuda", f"{gpus} GPU(s): {', '.join(names)}")
    elif shutil.which("nvidia-smi") and run_command(["nvidia-smi", "-L"])[0] == 0:
        if hidden is not None:
            gpu_why = (f"nvidia-smi lists GPUs, but CUDA_VISIBLE_DEVICES={hidden!r} leaves torch "
                       "none; unset it, or name GPUs that exist")
        elif not torch.version.cuda:
            gpu_why = ("nvidia-smi lists GPUs, but this torch is a CPU-only build; install the "
                       "CUDA build with pip install -r requirements.txt")
        else:
            gpu_why = (f"nvidia-smi lists GPUs, but torch (built for CUDA {torch.version.cuda}) "
                       "sees none: the NVIDIA driver is likely older than that CUDA version")
        report.add("FAIL", "cuda", gpu_why)
    else:
        gpu_why = "no GPU visible (no NVIDIA driver found)"
        report.add("SKIP", "cuda", f"{gpu_why}: the GPU commands are left out")

    gloo_ok = dist.is_gloo_available()
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    report.add("OK" if gloo_ok else "FAIL", "gloo",
               ("in this torch build" + (f"; GLOO_SOCKET_IFNAME={interface}" if interface else ""))
               if gloo_ok else "not in this torch build; reinstall torch from requirements.txt")
    nccl_built = dist.is_nccl_available()
    if nccl_built:
        try:
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # the version is a nicety; a build without it still has NCCL
            nccl_version = "?"
        report.add("OK" if gpus else "SKIP", "nccl", f"{nccl_version} in this torch build"
                   + ("" if gpus else ", but there is no GPU for it"))
    else:
        report.add("SKIP", "nccl", "not in this torch build (it is Linux-only); gloo does the "
                   "CPU lessons")

    # The port the test group uses: the one given, or MASTER_PORT as the lessons read it, or a
    # free one, as lesson 02 picks.
    address = args.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if not is_local_address(address):
        report.add("FAIL", "address", f"{address} is not an address of this machine")
        return finish(args, report, [], [], f"--master-addr {address} is not an address of "
                      "this machine, but the test processes run here; use 127.0.0.1")
    env_port = os.environ.get("MASTER_PORT", "")
    if env_port and not (env_port.isdigit() and 0 < int(env_port) < 65536):
        report.add("FAIL", "port", f"MASTER_PORT={env_port} is not a port number")
        return finish(args, report, [], [], f"MASTER_PORT={env_port} is not a port number; "
                      "unset it (the lessons then pick a free port)")
    port = args.master_port or int(env_port or 0) or find_free_port(address)
    busy = port_in_use(address, port)
    multi_node_port_free = not port_in_use(address, MULTI_NODE_PORT)
    spare_port = find_free_port(address)
    report.add("FAIL" if busy else "OK", "port",
               f"{address}:{port} is {'already in use' if busy else 'free'}; "
               f"{MULTI_NODE_PORT} (lesson 03's default with several nodes) is "
               + ("free" if multi_node_port_free else f"in use, so the commands below add "
                  f"--master-port {spare_port}"))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)

    gloo_why, error = "", None
    if not gloo_ok:
        gloo_why = "gloo is not in this torch build"
        error = "gloo is missing from this torch build; reinstall with pip install -r " \
                "requirements.txt"
    else:
        gloo_ok, detail = check_group("gloo", 2, args.timeout)
        report.add("OK" if gloo_ok else "FAIL", "gloo group", detail)
        if not gloo_ok:
            gloo_why = "two processes could not form a gloo group (the gloo group line above)"
            error = (f"the lesson 02 check failed: two processes could not form a gloo group "
                     f"at {address}:{port}; {fix_for_group_error(detail, address, port)}")

    nccl_ok, nccl_why = False, gpu_why or "NCCL is not in this torch build"
    if gpus and nccl_built:
        world = min(gpus, 2)
        os.environ["MASTER_PORT"] = str(find_free_port(address))
        nccl_ok, detail = check_group("nccl", world, args.timeout)
        report.add("OK" if nccl_ok else "FAIL", "nccl group", detail)
        nccl_why = "" if nccl_ok else f"{world} process(es) could not form an NCCL group (above)"
    else:
        report.add("SKIP", "nccl group", nccl_why)

    torchrun = torchrun_command(python)
    report.add("OK", "torchrun", f"run as: {torchrun}")
    sbatch = shutil.which("sbatch")
    slurm_answers, slurm_note, local_missing = False, "", ""
    if sbatch:
        code, output = run_command(["sinfo", "-h", "-o", "%D %T"])
        slurm_answers = code == 0 and bool(output)
        slurm_note = (f"a Slurm cluster answers (sinfo: {' '.join(output.split())})"
                      if slurm_answers else "no Slurm cluster answers here")
        # The daemons live in sbin, which is not on every user's PATH.
        search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        missing = [tool for tool in LOCAL_CLUSTER_TOOLS if not shutil.which(tool, path=search)]
        if platform.system() != "Linux":
            local_missing = "Linux (network namespaces)"
        elif missing:
            local_missing = f"{', '.join(missing)} (apt-get install slurm-wlm munge iproute2)"
        elif os.geteuid() != 0 and not shutil.which("sudo"):
            local_missing = "root (and there is no sudo)"
        report.add("OK", "slurm", f"sbatch at {sbatch}; {slurm_note}")
    else:
        report.add("SKIP", "slurm", "no sbatch: the Slurm commands are left out")

    facts = {"python": python, "torchrun": torchrun, "gpus": gpus, "gloo_ok": gloo_ok,
             "nccl_ok": nccl_ok, "gloo_why": gloo_why, "nccl_why": nccl_why,
             "gpu_why": gpu_why, "multi_node_port_free": multi_node_port_free,
             "spare_port": spare_port, "sbatch": sbatch, "slurm_answers": slurm_answers,
             "slurm_note": slurm_note, "local_cluster_missing": local_missing}
    can, cannot = plan(facts)
    if not python_ok and not error:
        error = f"Python {version} is too old; the lessons need Python 3.10 or newer"
    return finish(args, report, can, cannot, error)


def finish(args, report, can, cannot, error):
    """Print what runs and what does not; return the exit status (1 with an error line)."""
    if args.json:
        print(json.dumps({"ok": error is None, "checks": report.checks, "can_run": can,
                          "cannot_run": cannot, "error": error}, indent=2))
    else:
        if can:
            print("\nWhat this machine can run, from the repository root:")
            for entry in can:
                print(f"  {entry['lesson']}, {WHERE[entry['where']]}, {entry['note']}:")
                for command in entry["commands"]:
                    print(f"      {command}")
        if cannot:
            print("\nWhat it cannot run, and why:")
            for entry in cannot:
                print(f"  {entry['lesson']}, {WHERE[entry['where']]}: {entry['reason']}")
        if error is None:
            print("\nReady: this machine can run the lessons listed above.", flush=True)
    if error is not None:
        sys.stdout.flush()
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 00: check what this machine can run, then list the commands.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON object instead of text")
    parser.add_argument("--master-addr",
                        help="the address the test processes meet at (default: $MASTER_ADDR, "
                             "else 127.0.0.1)")
    parser.add_argument("--master-port", type=int,
                        help="the port they meet at (default: $MASTER_PORT, else a free one)")
    parser.add_argument("--timeout", type=float, default=30,
                        help="seconds each test process waits for the other, to form the "
                             "group and in the all_reduce")
    args = parser.parse_args(argv)
    if args.master_port is not None and not 0 < args.master_port < 65536:
        sys.exit(f"error: --master-port must be a port number, 1 .. 65535 "
                 f"(got {args.master_port})")
    # nan passes the comparison below, and a timedelta cannot hold inf: the lessons' rule too.
    if not math.isfinite(args.timeout):
        sys.exit(f"error: --timeout must be a finite number (got {args.timeout})")
    if args.timeout <= 0:
        sys.exit(f"error: --timeout must be positive (got {args.timeout:g})")
    if args.timeout > 3e7:  # larger ones overflow inside torch (the lessons' check_args)
        sys.exit(f"error: --timeout must be at most 3e7 seconds, about a year (got "
                 f"{args.timeout:g})")
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
