"""Lesson 05, run as a learner runs it: DDP over a model split across two devices per rank.

Here both stages sit on the CPU (gloo); the real split across GPUs is in test_gpu.py."""


import pytest
import torch

from helpers import (
    GPUS,
    assert_good_run,
    assert_one_line_error,
    error_lines,
    evaluate_single_process,
    import_lesson,
    lesson02_run,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
)

LESSON = "05_model_parallel_ddp"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist


def two_ranks(lesson_run):
    """The run these tests share (lesson_run makes it once): 2 ranks x batch 16, as lesson 02's."""
    return lesson_run(LESSON, *CPU, "--world-size", 2, "--batch-size", 16)


def test_two_cpu_ranks_learn_and_count_every_test_wine(lesson_run):
    result, out_dir = two_ranks(lesson_run)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.9)
    assert (metrics["backend"], metrics["device"]) == ("gloo", "cpu")
    assert metrics["stage_devices"] == ["cpu", "cpu"]
    assert metrics["test_total"] == 36
    # final.pt loads into lesson 01's WineMLP and scores there what the run reported.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


def test_placement_does_not_change_the_math(lesson_run):
    # Same seed and flags as lesson 02's run (the cache shares it with lesson 02's tests).
    _, spawn = lesson02_run(lesson_run, 2)
    result, split = two_ranks(lesson_run)
    assert result.returncode == 0, result.stderr
    assert read_metrics(split)["train_loss"] == pytest.approx(read_metrics(spawn)["train_loss"])
    assert max_weight_difference(spawn, split) < 1e-5


def test_split_forward_and_backward_equal_the_unsplit_model():
    lesson01, lesson05 = import_lesson("01_single_gpu"), import_lesson(LESSON)
    torch.manual_seed(1)
    plain = lesson01.WineMLP()
    split = lesson05.WineMLP("cpu", "cpu")
    split.load_state_dict(plain.state_dict())
    assert list(split.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    x = torch.randn(16, 13)
    labels = torch.randint(0, 3, (16,))
    outputs = []
    for model in (plain, split):
        output = model(x)
        torch.nn.functional.cross_entropy(output, labels).backward()
        outputs.append(output.detach())
    torch.testing.assert_close(outputs[1], outputs[0])
    for name, parameter in plain.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0
        torch.testing.assert_close(split.get_parameter(name).grad, parameter.grad)


@pytest.mark.parametrize(
    "gpus, world_size, devices, note",
    [
        (0, 2, [("cpu", "cpu")] * 2, ""),
        (1, 1, [("cuda:0", "cuda:0")], "both stages of the model share cuda:0"),
        (2, 1, [("cuda:0", "cuda:1")], ""),
        (3, 1, [("cuda:0", "cuda:1")], "cuda:2 stays idle"),
        (4, 2, [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")], ""),
        (8, 4, [(f"cuda:{2 * r}", f"cuda:{2 * r + 1}") for r in range(4)], ""),
    ],
)
def test_device_plan(gpus, world_size, devices, note):
    plan = import_lesson(LESSON).plan_devices(gpus, None)
    assert plan[:2] == (world_size, devices)
    if note:
        assert note in plan[2]
    else:
        assert plan[2] == ""


def test_device_plan_takes_a_smaller_world_size_and_any_on_the_cpu():
    plan_devices = import_lesson(LESSON).plan_devices
    assert plan_devices(8, 1)[:2] == (1, [("cuda:0", "cuda:1")])
    assert plan_devices(0, 5)[:2] == (5, [("cpu", "cpu")] * 5)


@pytest.mark.parametrize(
    "gpus, world_size, fragments",
    [
        (4, 3, ["--world-size 3 needs 6 GPUs (2 per rank)", "use --world-size 2"]),
        (1, 2, ["needs 4 GPUs", "use --world-size 1 or --backend gloo"]),
        (2, 2, ["needs 4 GPUs", "use --world-size 1"]),
        (3, 2, ["but 3 visible", "use --world-size 1"]),
    ],
)
def test_device_plan_refuses_too_many_ranks(gpus, world_size, fragments):
    with pytest.raises(ValueError) as error:
        import_lesson(LESSON).plan_devices(gpus, world_size)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_torchrun_starts_the_ranks_instead_of_spawn(tmp_path):
    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; the lesson must run as that rank.
    result = run_torchrun(LESSON, *CPU, "--epochs", 3, "--out-dir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = read_metrics(tmp_path)
    assert (metrics["world_size"], metrics["test_total"]) == (2, 36)
    assert "starting 2 ranks" not in result.stdout  # nothing was spawned
    assert result.stdout.count("test accuracy:") == 1  # rank 0 alone prints


def test_world_size_zero_gets_one_clear_line(tmp_path):
    result = run_lesson(LESSON, *CPU, "--world-size", 0, "--out-dir", tmp_path)
    assert_one_line_error(result, "--world-size must be at least 1")


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_nccl_group_is_not_bound_to_one_gpu_when_a_rank_spans_two(monkeypatch, gpus):
    # With device_id, init_process_group binds the NCCL group to that one GPU, and NCCL then
    # refuses every collective on another ("backend constrained to cuda:0"): DDP's all-reduce
    # of fc2's gradients runs on dev1. Recorded here without a GPU: what setup_process_group
    # asks of torch for each rank of the plan for this many GPUs.
    lesson = import_lesson(LESSON)
    pinned, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pinned.append(device))
    monkeypatch.setattr(lesson.dist, "init_process_group",
                        lambda *args, **kwargs: joined.append((args, kwargs)))
    world_size, devices, _ = lesson.plan_devices(gpus)
    for rank, (dev0, dev1) in enumerate(devices):
        assert dev0 != dev1  # this rank spans two GPUs
        device = lesson.setup_process_group(rank, world_size, "nccl", dev0, 120)
        assert device == torch.device(dev0)
    # Each rank's default GPU is its first one, and no rank's group is bound to it.
    assert pinned == [torch.device(dev0) for dev0, _ in devices]
    assert len(joined) == world_size
    for args, kwargs in joined:
        assert args[:1] == ("nccl",) or kwargs.get("backend") == "nccl"
        assert kwargs.get("device_id") is None, kwargs


def test_cpu_ranks_share_the_cores_of_their_own_machine(monkeypatch):
    # Under torchrun on 2 machines of 2 ranks each, a rank shares its machine's cores with 1
    # other rank, not with 3: LOCAL_WORLD_SIZE, not the world size, divides them.
    lesson = import_lesson(LESSON)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(lesson.dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(lesson.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # what torchrun sets in every rank
    lesson.setup_process_group(3, 4, "gloo", "cpu", 120)
    # mp.spawn: every rank is on this machine, even where a cluster's environment exports
    # LOCAL_WORLD_SIZE to every process; only torchrun's own value counts.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    lesson.setup_process_group(3, 4, "gloo", "cpu", 120)
    assert threads == [4, 2]


def test_device_plan_under_torchrun_names_torchruns_flag():
    # Under torchrun the ranks per machine come from torchrun's --nproc-per-node; the script's
    # --world-size does not apply there, so the fix must not name it.
    with pytest.raises(ValueError) as error:
        import_lesson(LESSON).plan_devices(2, 2, "torchrun's --nproc-per-node")
    assert "torchrun's --nproc-per-node 2 needs 4 GPUs" in str(error.value)
    assert "use torchrun's --nproc-per-node 1" in str(error.value)
    assert "--world-size" not in str(error.value)


@pytest.mark.skipif(GPUS > 0, reason="this machine has GPUs, so --backend nccl is valid here")
def test_a_bad_request_under_torchrun_is_said_once_not_once_per_rank(tmp_path):
    result = run_torchrun(LESSON, "--backend", "nccl", "--out-dir", tmp_path, nproc=2)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert "--backend nccl needs CUDA GPUs" in errors[0]
