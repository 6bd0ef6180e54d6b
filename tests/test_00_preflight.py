"""Lesson 00, run as a learner runs it: python 00_preflight/preflight.py, before anything else."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from helpers import GPUS, NO_GPUS, ROOT, assert_one_line_error, import_lesson

SCRIPT = str(ROOT / "00_preflight" / "preflight.py")


def run_preflight(*args, python=(sys.executable,), env=None):
    return subprocess.run([*python, SCRIPT, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def preflight():
    """One plain run on this machine, as the README's first command."""
    return run_preflight()


def status_line(output, name):
    """(status, detail) of one check's line: "  OK    gloo group   2 processes met ..."."""
    found = [(line[2:6].strip(), line[21:]) for line in output.splitlines()
             if line[2:6].strip() in ("OK", "FAIL", "SKIP") and line[8:20].strip() == name]
    assert len(found) == 1, f"no single line for {name!r} in:\n{output}"
    return found[0]


def listed_commands(output):
    """The commands under "What this machine can run", one per indented line."""
    section = output.split("What this machine can run", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("      ")]


def test_finds_gloo_and_all_reduces_across_two_processes(preflight):
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr
    assert status_line(preflight.stdout, "gloo")[0] == "OK"
    status, detail = status_line(preflight.stdout, "gloo group")
    # Two spawned processes, ranks 0 and 1, all_reduce [1] and [2]: both must hold 3.
    assert status == "OK", detail
    assert "2 processes met at 127.0.0.1:" in detail
    assert "all_reduce gave 3 on every rank" in detail
    assert "Ready: this machine can run the lessons listed above." in preflight.stdout
    assert "error:" not in preflight.stderr


def test_every_check_says_ok_fail_or_skip(preflight):
    for name in ("python", "torch", "cpu", "cuda", "gloo", "nccl", "port", "torchrun", "slurm"):
        _, detail = status_line(preflight.stdout, name)  # fails unless exactly one line
        assert detail.strip(), f"{name}: no reason given"


def test_lists_the_cpu_command_of_every_lesson_present(preflight):
    commands = "\n".join(listed_commands(preflight.stdout))
    assert "01_single_gpu/train.py" in commands
    assert "02_multi_gpu_spawn/train.py --world-size 2" in commands
    # Lesson 03 as two nodes on this machine: one command per node, node ranks 0 and 1.
    assert "03_multi_node/train.py --nnodes 2 --node-rank 0" in commands
    assert "03_multi_node/train.py --nnodes 2 --node-rank 1" in commands
    assert "--standalone --nproc-per-node 2 03_multi_node/train.py" in commands
    assert "05_model_parallel_ddp/train.py --world-size 2" in commands
    assert "06_ddp_in_practice/train.py --world-size 2 --precision bf16" in commands
    assert "07_sharding/train.py --world-size 2" in commands
    assert "08_ddp_from_scratch/train.py --world-size 2" in commands
    assert "09_tensor_parallel/train.py --tp 2 --dp 1" in commands
    assert "10_pipeline_parallel/train.py --stages 2 --dp 1" in commands
    assert "11_context_parallel/train.py --cp 2 --dp 1" in commands
    assert "12_expert_parallel/train.py --ep 2 --dp 1" in commands
    assert "13_capstone/train.py --dp 2 --pp 2 --tp 2" in commands
    assert ("14_planning/plan.py --model tiny --gpus 8 --layout 2,2,2 --batch-size 16 "
            "--microbatches 2") in commands
    if not (ROOT / "04_checkpointing" / "train.py").is_file():
        assert ("04_checkpointing, CPU: 04_checkpointing/train.py is not in this copy of the "
                "repository") in preflight.stdout


def test_listed_commands_are_valid_for_their_lessons(preflight):
    # Every flag the preflight prints must be one the lesson accepts: parse each command's
    # arguments with the lesson's own parse_args (argparse exits on an unknown flag, and the
    # lessons on a bad value). Lesson 04's commands are checked here once it is in the repository.
    checked = 0
    for command in listed_commands(preflight.stdout):
        match = re.search(r"(\d\d_\w+)/train\.py(.*)$", command)
        if not match:
            continue  # Slurm's commands: sbatch, squeue, the local cluster
        lesson, arguments = match.group(1), shlex.split(match.group(2))
        try:
            import_lesson(lesson).parse_args(arguments)
        except SystemExit as error:
            pytest.fail(f"{command!r}: {lesson} rejects these arguments ({error})")
        checked += 1
    assert checked >= 5


def test_without_gpus_the_gpu_commands_are_left_out_with_the_reason(preflight):
    # On a GPU machine, the same run with the GPUs hidden is what a CPU machine sees.
    result = preflight if GPUS == 0 else run_preflight(env={**os.environ, **NO_GPUS})
    assert result.returncode == 0, result.stdout + result.stderr
    assert status_line(result.stdout, "cuda")[0] in ("SKIP", "FAIL")
    assert status_line(result.stdout, "nccl group")[0] == "SKIP"
    assert "every lesson, GPU: " in result.stdout
    assert "--backend gloo" not in result.stdout  # the CPU is the default here


def test_the_slurm_line_follows_whether_sbatch_exists(preflight):
    status, _ = status_line(preflight.stdout, "slurm")
    assert (status == "OK") == (shutil.which("sbatch") is not None)
    # Listed either way: with its commands, or with the reason it cannot run here.
    assert "03_multi_node, Slurm" in preflight.stdout


def test_a_port_in_use_fails_the_group_with_one_error_line_that_names_the_fix():
    # A real failure, not a switch: rank 0 of the test group cannot listen on a port that a
    # server already holds, as when an earlier run is still alive.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_preflight("--json", "--master-port", port)
    error = assert_one_line_error(result, f"port {port} is already in use", "--master-port")
    assert error.startswith("error: the lesson 02 check failed")
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["error"] in error
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["port"]["status"] == "FAIL"
    assert checks["gloo group"]["status"] == "FAIL"
    assert "EADDRINUSE" in checks["gloo group"]["detail"]  # torch's own words for it
    cannot = {(entry["lesson"], entry["where"]) for entry in report["cannot_run"]}
    assert ("02_multi_gpu_spawn", "cpu") in cannot
    # Of the CPU commands, lesson 01's and 14's alone are still listed: 01 needs no process
    # group, 14 only PyTorch's fake one.
    assert [entry["lesson"] for entry in report["can_run"] if entry["where"] == "cpu"] == [
        "01_single_gpu", "14_planning"]


def test_a_python_without_torch_gets_one_error_line_that_names_the_fix():
    # -S leaves out site-packages: the interpreter of a virtual environment that is not active.
    result = run_preflight(python=(sys.executable, "-S"))
    assert_one_line_error(result, "torch is not installed for this Python",
                          "pip install -r requirements.txt")
    assert "FAIL  torch" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--master-port", "0"], "--master-port must be a port number"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_input_gets_one_clear_line(args, fragment):
    assert_one_line_error(run_preflight(*args), fragment)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs and NCCL")
def test_gpu_commands(preflight):
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr
    assert status_line(preflight.stdout, "cuda")[1].startswith(f"{GPUS} GPU(s): ")
    status, detail = status_line(preflight.stdout, "nccl group")
    assert status == "OK", detail
    # One process per GPU, two at most: ranks 0 and 1 all_reduce [1] and [2].
    world = min(GPUS, 2)
    assert f"{world} processes met at" in detail
    assert f"all_reduce gave {world * (world + 1) // 2} on every rank" in detail
    assert f"02_multi_gpu_spawn, GPU, {GPUS} rank(s), one per GPU, NCCL" in preflight.stdout
    assert f"--standalone --nproc-per-node {GPUS} 03_multi_node/train.py" in preflight.stdout
    # On a GPU machine the CPU commands must say gloo, or the lessons would pick NCCL.
    assert "02_multi_gpu_spawn/train.py --world-size 2 --backend gloo" in preflight.stdout


def load_preflight(root):
    """The preflight as a module, looking for lessons under root instead of this repository."""
    spec = importlib.util.spec_from_file_location("preflight", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ROOT = root
    return module


def machine(**overrides):
    """The facts main() gathers, for a CPU laptop where everything works; overrides change it."""
    facts = {"python": "python", "torchrun": "torchrun", "gpus": 0, "gloo_ok": True,
             "nccl_ok": False, "gloo_why": "", "nccl_why": "no GPU visible", "gpu_why":
             "no GPU visible", "multi_node_port_free": True, "spare_port": 40000,
             "sbatch": None, "slurm_answers": False, "slurm_note": "",
             "local_cluster_missing": ""}
    return {**facts, **overrides}


@pytest.fixture
def full_repository(tmp_path):
    # Every lesson and the Slurm files present, as in a complete checkout.
    for path in ("01_single_gpu/train.py", "02_multi_gpu_spawn/train.py", "03_multi_node/train.py",
                 "04_checkpointing/train.py", "05_model_parallel_ddp/train.py",
                 "06_ddp_in_practice/train.py",
                 "07_sharding/train.py", "08_ddp_from_scratch/train.py",
                 "09_tensor_parallel/train.py", "10_pipeline_parallel/train.py",
                 "11_context_parallel/train.py", "12_expert_parallel/train.py",
                 "13_capstone/train.py", "14_planning/plan.py",
                 "03_multi_node/slurm/train.sbatch", "03_multi_node/slurm/local_cluster.sh"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    return load_preflight(tmp_path)


def commands_for(can, lesson, where):
    return [c for entry in can if (entry["lesson"], entry["where"]) == (lesson, where)
            for c in entry["commands"]]


def test_plan_on_a_machine_with_four_gpus(full_repository):
    # The GPU branch, which this CPU machine cannot reach by running the script.
    can, cannot = full_repository.plan(machine(gpus=4, nccl_ok=True, nccl_why=""))
    assert commands_for(can, "02_multi_gpu_spawn", "gpu") == ["python 02_multi_gpu_spawn/train.py"]
    assert commands_for(can, "06_ddp_in_practice", "gpu") == [
        "python 06_ddp_in_practice/train.py --precision bf16 --clip-grad-norm 1"]
    assert commands_for(can, "03_multi_node", "gpu") == [
        "torchrun --standalone --nproc-per-node 4 03_multi_node/train.py"]
    # The CPU commands must keep to gloo and 2 processes, or the lessons would take the GPUs.
    assert commands_for(can, "02_multi_gpu_spawn", "cpu") == [
        "python 02_multi_gpu_spawn/train.py --world-size 2 --backend gloo"]
    assert ("python 03_multi_node/train.py --nnodes 2 --node-rank 0 --nproc-per-node 2 "
            "--backend gloo") in commands_for(can, "03_multi_node", "cpu")
    assert commands_for(can, "01_single_gpu", "cpu") == [
        "python 01_single_gpu/train.py --device cpu"]
    # Lesson 04's default world size is also one rank per GPU, with --backend gloo too.
    assert commands_for(can, "04_checkpointing", "cpu") == [
        "python 04_checkpointing/train.py --save-every 2 --crash-at-epoch 3 --world-size 2 "
        "--backend gloo",
        "python 04_checkpointing/train.py --save-every 2 --world-size 2 --backend gloo"]
    assert commands_for(can, "05_model_parallel_ddp", "cpu") == [
        "python 05_model_parallel_ddp/train.py --world-size 2 --backend gloo"]
    # Lessons 10 to 12 on GPUs: 2 pipelines, 2 CP or EP groups (--dp from the GPUs); on the
    # CPU, --dp 1, or their --dp would count the 4 GPUs and start 4 CPU ranks.
    assert commands_for(can, "10_pipeline_parallel", "gpu") == [
        "python 10_pipeline_parallel/train.py"]
    assert commands_for(can, "11_context_parallel", "cpu") == [
        "python 11_context_parallel/train.py --cp 2 --dp 1 --backend gloo"]
    assert commands_for(can, "12_expert_parallel", "gpu") == ["python 12_expert_parallel/train.py"]
    assert commands_for(can, "12_expert_parallel", "cpu") == [
        "python 12_expert_parallel/train.py --ep 2 --dp 1 --backend gloo"]
    # Lesson 13 on 4 GPUs: one pipeline of 2 stages of 2 TP GPUs; on the CPU its 8 ranks.
    assert commands_for(can, "13_capstone", "gpu") == ["python 13_capstone/train.py"]
    assert commands_for(can, "13_capstone", "cpu") == [
        "python 13_capstone/train.py --dp 2 --pp 2 --tp 2 --backend gloo"]
    # Lesson 14 uses no GPU and no gloo: one command on every machine.
    assert commands_for(can, "14_planning", "cpu") == [
        "python 14_planning/plan.py --model tiny --gpus 8 --layout 2,2,2 --batch-size 16 "
        "--microbatches 2"]
    assert not [entry for entry in cannot if entry["where"] == "gpu"]


def test_plan_on_one_gpu_says_why_lessons_10_to_12_stay_on_the_cpu(full_repository):
    can, cannot = full_repository.plan(machine(gpus=1, nccl_ok=True, nccl_why=""))
    assert not commands_for(can, "10_pipeline_parallel", "gpu")
    assert commands_for(can, "11_context_parallel", "cpu") == [
        "python 11_context_parallel/train.py --cp 2 --dp 1 --backend gloo"]
    reasons = {entry["lesson"]: entry["reason"] for entry in cannot if entry["where"] == "gpu"}
    assert set(reasons) == {"10_pipeline_parallel", "11_context_parallel", "12_expert_parallel",
                            "13_capstone"}
    assert reasons["13_capstone"].startswith("1 GPU(s), and it needs 4, one per rank")
    assert reasons["10_pipeline_parallel"].startswith("one GPU, and it needs 2, a stage on each")
    assert reasons["12_expert_parallel"].startswith("one GPU, and it needs 2, half of the experts")


def test_plan_when_nccl_fails_keeps_the_cpu_commands(full_repository):
    can, cannot = full_repository.plan(machine(gpus=2, nccl_ok=False, nccl_why="NCCL failed"))
    assert {entry["lesson"] for entry in can if entry["where"] == "gpu"} == {"01_single_gpu"}
    assert {entry["reason"] for entry in cannot if entry["where"] == "gpu"} == {"NCCL failed"}
    assert commands_for(can, "05_model_parallel_ddp", "cpu")


def test_plan_with_a_busy_multi_node_port_moves_lesson_03(full_repository):
    can, _ = full_repository.plan(machine(multi_node_port_free=False, spare_port=40123))
    assert all("--master-port 40123" in c for c in commands_for(can, "03_multi_node", "cpu")
               if "--nnodes 2" in c)


@pytest.mark.parametrize("facts, expected", [
    (machine(), None),
    (machine(sbatch="/usr/bin/sbatch", slurm_answers=True, slurm_note="a Slurm cluster answers"),
     ["sbatch 03_multi_node/slurm/train.sbatch", "squeue"]),
    (machine(sbatch="/usr/bin/sbatch", slurm_note="no Slurm cluster answers here"),
     ["bash 03_multi_node/slurm/local_cluster.sh start",
      "export SLURM_CONF=/tmp/ddp-slurm/slurm.conf",
      "sbatch 03_multi_node/slurm/train.sbatch --epochs 5 --out-dir runs/slurm", "squeue",
      "bash 03_multi_node/slurm/local_cluster.sh stop"]),
    (machine(sbatch="/usr/bin/sbatch", slurm_note="no Slurm cluster answers here",
             local_cluster_missing="slurmd, munged"), None),
], ids=["no sbatch", "a cluster answers", "local cluster", "local cluster impossible"])
def test_slurm_commands_follow_what_the_machine_has(full_repository, facts, expected):
    full_repository.LOCAL_SLURM_CONF = "/tmp/ddp-slurm/slurm.conf"  # whatever DDP_SLURM_DIR says
    can, cannot = full_repository.plan(facts)
    if expected is None:
        reasons = [entry["reason"] for entry in cannot if entry["where"] == "slurm"]
        assert len(reasons) == 1 and ("sbatch" in reasons[0] or "slurmd" in reasons[0])
        assert not commands_for(can, "03_multi_node", "slurm")
    else:
        assert commands_for(can, "03_multi_node", "slurm") == expected


def test_a_missing_lesson_is_named_not_listed(tmp_path):
    (tmp_path / "01_single_gpu").mkdir()
    (tmp_path / "01_single_gpu" / "train.py").touch()
    can, cannot = load_preflight(tmp_path).plan(machine())
    assert [entry["lesson"] for entry in can] == ["01_single_gpu"]
    assert ("02_multi_gpu_spawn", "02_multi_gpu_spawn/train.py is not in this copy of the "
            "repository") in {(entry["lesson"], entry["reason"]) for entry in cannot}
