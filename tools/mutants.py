"""The course's deliberate mistakes: each breaks one claim a README makes, and a test catches it.

`python tools/mutate.py` applies each one to a fresh copy of the repository and runs its tests
there; a mistake that every test lets through is a claim without a proof. The table of claims,
tests and mistakes in tests/README.md is printed from this list (`python tools/mutate.py --table`).

An entry replaces `find`, which must occur exactly once in `file` (else the list has gone stale), by
`replace`: one line that a learner writes by mistake ("learner") or that a tidy-up could slip in
("refactor"). `tests` name the fewest and fastest tests that must fail on it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str  # "02-loss-from-rank-0": the lesson's number, then the mistake in a few words
    file: str  # relative to the repository root, e.g. "02_multi_gpu_spawn/train.py"
    find: str  # text that occurs exactly once in file
    replace: str  # what replaces it: the mistake
    claim: str  # the claim it breaks, as the README states it, in one short sentence
    readme: str  # where that claim is made, e.g. "02_multi_gpu_spawn/README.md#global-metrics"
    tests: tuple  # pytest node ids ("tests/test_x.py::test_y") that must fail on it
    kind: str = "learner"  # "learner" (a mistake learners make) or "refactor"


PROVE_13 = ("tests/test_13_capstone.py::"
            "test_every_layout_takes_one_processs_steps_and_each_mistake_does_not")

MUTANTS = [
    # --- lesson 02: mp.spawn, DistributedSampler, all-reduced metrics ---
    Mutant(
        id="02-no-set-epoch",
        file="02_multi_gpu_spawn/train.py",
        find="self.train_loader.sampler.set_epoch(epoch)",
        replace="pass",
        claim="set_epoch gives every epoch a new order, the same on every rank.",
        readme="02_multi_gpu_spawn/README.md"
               "#each-rank-its-own-slice-distributedsampler-and-set_epoch",
        tests=("tests/test_02_multi_gpu_spawn.py::test_trainer_calls_set_epoch_every_epoch",),
    ),
    Mutant(
        id="02-evaluation-counts-not-reduced",
        file="02_multi_gpu_spawn/train.py",
        find="dist.all_reduce(counts, op=dist.ReduceOp.SUM)",
        replace="pass",
        claim="Evaluation counts every test wine once, over all ranks.",
        readme="02_multi_gpu_spawn/README.md#evaluation-counts-every-test-wine-once",
        tests=("tests/test_02_multi_gpu_spawn.py::"
               "test_evaluation_counts_each_test_wine_exactly_once[2]",),
    ),
    Mutant(
        id="02-loss-from-rank-0",
        file="02_multi_gpu_spawn/train.py",
        find="        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank's slice: the "
             "mean over all\n",
        replace="",
        claim="The loss rank 0 prints is the mean over every rank's samples, not its own.",
        readme="02_multi_gpu_spawn/README.md#rank-0-prints-and-writes-the-figures-cover-every-rank",
        tests=("tests/test_02_multi_gpu_spawn.py::"
               "test_the_printed_loss_is_the_mean_over_every_rank",),
    ),
    Mutant(
        id="02-fork-server-outlives-the-launcher",
        file="02_multi_gpu_spawn/guard_rails.py",
        find="os.kill(pid, signal.SIGTERM)  # a later start_ranks starts a new one",
        replace="pass  #",
        claim="The fork server ends with the launcher, not seconds after it.",
        readme="02_multi_gpu_spawn/README.md#ranks-started-by-mpspawn",
        tests=("tests/test_02_multi_gpu_spawn.py::"
               "test_the_ranks_are_forked_from_a_server_that_imported_torch_once",),
        kind="refactor",
    ),
    Mutant(
        id="02-ranks-spawned",
        file="02_multi_gpu_spawn/guard_rails.py",
        find='mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")',
        replace="mp.spawn(fn, args=args, nprocs=nprocs)",
        claim="Each rank is forked from a server that has imported torch: torch is not imported "
              "again per rank.",
        readme="02_multi_gpu_spawn/README.md#ranks-started-by-mpspawn",
        tests=("tests/test_02_multi_gpu_spawn.py::"
               "test_the_ranks_are_forked_from_a_server_that_imported_torch_once",),
        kind="refactor",
    ),
    # --- lesson 03: torchrun, global and local rank ---
    Mutant(
        id="03-global-rank-is-local-rank",
        file="03_multi_node/train.py",
        find="return node_rank * nproc_per_node + local_rank",
        replace="return local_rank",
        claim="Each global rank appears exactly once, on every node.",
        readme="03_multi_node/README.md#the-rank-arithmetic-2-nodes--2-gpus",
        tests=("tests/test_03_multi_node.py::test_global_rank_gives_every_rank_exactly_once",),
    ),
    Mutant(
        id="03-global-rank-adds-the-ranks",
        file="03_multi_node/train.py",
        find="return node_rank * nproc_per_node + local_rank",
        replace="return node_rank + local_rank",
        claim="The global rank is node_rank * nproc_per_node + local_rank.",
        readme="03_multi_node/README.md#the-rank-arithmetic-2-nodes--2-gpus",
        tests=("tests/test_03_multi_node.py::test_global_rank_gives_every_rank_exactly_once",),
    ),
    Mutant(
        id="03-data-sliced-by-local-rank",
        file="03_multi_node/train.py",
        find="train_set, args.batch_size, args.seed, rank, args.world_size)",
        replace="train_set, args.batch_size, args.seed, local_rank, args.world_size)",
        claim="The global rank picks each process's slice of the data.",
        readme="03_multi_node/README.md#the-rank-arithmetic-2-nodes--2-gpus",
        tests=("tests/test_03_multi_node.py::"
               "test_two_nodes_by_hand_equal_lesson02_with_four_ranks",),
    ),
    Mutant(
        id="03-every-nodes-first-rank-writes",
        file="03_multi_node/train.py",
        find="    if not trainer.is_main_process:\n        if local_rank == 0:",
        replace="    if local_rank != 0:\n        if local_rank == 0:",
        claim="Only global rank 0 writes; gated on the local rank, every node would.",
        readme="03_multi_node/README.md#the-rank-arithmetic-2-nodes--2-gpus",
        tests=("tests/test_03_multi_node.py::"
               "test_two_nodes_by_hand_equal_lesson02_with_four_ranks",),
    ),
    Mutant(
        id="03-world-size-of-one-node",
        file="03_multi_node/train.py",
        find="args.world_size = args.nnodes * args.nproc_per_node",
        replace="args.world_size = args.nproc_per_node",
        claim="world_size counts every process on every node.",
        readme="03_multi_node/README.md#the-rank-arithmetic-2-nodes--2-gpus",
        tests=("tests/test_03_multi_node.py::"
               "test_two_nodes_by_hand_equal_lesson02_with_four_ranks",),
    ),
    # --- lesson 04: checkpoints, resume ---
    Mutant(
        id="04-resume-skips-an-epoch",
        file="04_checkpointing/train.py",
        find="for epoch in range(self.epochs_completed, max_epochs):",
        replace="for epoch in range(self.epochs_completed + 1, max_epochs):",
        claim="A resumed run ends bitwise equal to the run that never crashed.",
        readme="04_checkpointing/README.md#a-resume-continues-the-same-run-or-says-why-not",
        tests=("tests/test_04_checkpointing.py::"
               "test_crash_then_resume_equals_the_run_that_never_crashed[1-again0]",),
    ),
    Mutant(
        id="04-optimizer-state-not-loaded",
        file="04_checkpointing/train.py",
        find='self.optimizer.load_state_dict(snapshot["optimizer"])',
        replace="pass",
        claim="The snapshot holds Adam's state: without it the resumed run takes other steps.",
        readme="04_checkpointing/README.md#what-is-in-a-snapshot-and-why-each-piece",
        tests=("tests/test_04_checkpointing.py::"
               "test_crash_then_resume_equals_the_run_that_never_crashed[1-again0]",),
    ),
    Mutant(
        id="04-load-without-map-location",
        file="04_checkpointing/train.py",
        find="torch.load(snapshot_file, map_location=self.device, weights_only=True)",
        replace="torch.load(snapshot_file, weights_only=True)",
        claim="Each rank loads the snapshot onto its own device (map_location), not cuda:0.",
        readme="04_checkpointing/README.md#loading-map_location-and-weights_onlytrue",
        tests=("tests/test_04_checkpointing.py::"
               "test_crash_then_resume_equals_the_run_that_never_crashed[2-again1]",),
    ),
    Mutant(
        id="04-load-with-weights-only-false",
        file="04_checkpointing/train.py",
        find="torch.load(snapshot_file, map_location=self.device, weights_only=True)",
        replace="torch.load(snapshot_file, map_location=self.device, weights_only=False)",
        claim="weights_only=True builds tensors and plain containers only: a file cannot run code.",
        readme="04_checkpointing/README.md#loading-map_location-and-weights_onlytrue",
        tests=("tests/test_04_checkpointing.py::"
               "test_the_lessons_own_loader_refuses_a_file_that_runs_code",),
    ),
    Mutant(
        id="04-local-rank-0-writes",
        file="04_checkpointing/train.py",
        find="        self.is_main_process = self.rank == 0",
        replace='        self.is_main_process = int(os.environ.get("LOCAL_RANK", self.rank)) == 0',
        claim="Global rank 0 alone writes, not local rank 0, which exists once per node.",
        readme="04_checkpointing/README.md#why-rank-0-alone-writes-and-the-barrier",
        tests=("tests/test_04_checkpointing.py::"
               "test_only_global_rank_0_writes_when_two_nodes_share_the_out_dir",),
    ),
    Mutant(
        id="04-resume-without-the-weights",
        file="04_checkpointing/train.py",
        find='self.model.module.load_state_dict(snapshot["model"])',
        replace='self.model.module.state_dict().update(snapshot["model"])',
        claim="Another number of ranks may resume a snapshot: it goes on from its weights.",
        readme="04_checkpointing/README.md#a-resume-continues-the-same-run-or-says-why-not",
        tests=("tests/test_04_checkpointing.py::test_a_snapshot_resumes_with_another_world_size",),
        kind="refactor",
    ),
    # --- lesson 05: a model split over two devices, DDP over the pairs ---
    Mutant(
        id="05-ranks-share-a-gpu",
        file="05_model_parallel_ddp/train.py",
        find='[(f"cuda:{2 * rank}", f"cuda:{2 * rank + 1}") for rank in range(world_size)]',
        replace='[(f"cuda:{rank}", f"cuda:{rank + 1}") for rank in range(world_size)]',
        claim="Rank r holds fc1 on cuda:2r and fc2 on cuda:2r+1: no GPU serves two ranks.",
        readme="05_model_parallel_ddp/README.md#the-device-plan",
        tests=("tests/test_05_model_parallel_ddp.py::test_device_plan",),
    ),
    Mutant(
        id="05-group-bound-to-one-gpu",
        file="05_model_parallel_ddp/train.py",
        find="device_id=None)",
        replace="device_id=device)",
        claim="init_process_group gets no device_id: a rank's group must reach both its GPUs.",
        readme="05_model_parallel_ddp/README.md#why-init_process_group-gets-no-device_id",
        tests=("tests/test_05_model_parallel_ddp.py::"
               "test_nccl_group_is_not_bound_to_one_gpu_when_a_rank_spans_two",),
    ),
    Mutant(
        id="05-stages-built-in-another-order",
        file="05_model_parallel_ddp/model.py",
        find="        self.fc1 = nn.Linear(in_features, hidden).to(self.dev0)\n"
             "        self.fc2 = nn.Linear(hidden, classes).to(self.dev1)",
        replace="        self.fc2 = nn.Linear(hidden, classes).to(self.dev1)\n"
                "        self.fc1 = nn.Linear(in_features, hidden).to(self.dev0)",
        claim="The split changes no math: the same losses and weights as lesson 02.",
        readme="05_model_parallel_ddp/README.md#the-split-model-computes-what-the-whole-one-does",
        tests=("tests/test_05_model_parallel_ddp.py::test_placement_does_not_change_the_math",),
        kind="refactor",
    ),
    Mutant(
        id="05-split-loses-the-relu",
        file="05_model_parallel_ddp/model.py",
        find="hidden = F.relu(self.fc1(x.to(self.dev0)))",
        replace="hidden = self.fc1(x.to(self.dev0))",
        claim="The split model gives the unsplit model's output and gradients.",
        readme="05_model_parallel_ddp/README.md#the-split-model-computes-what-the-whole-one-does",
        tests=("tests/test_05_model_parallel_ddp.py::"
               "test_split_forward_and_backward_equal_the_unsplit_model",),
        kind="refactor",
    ),
    # --- lesson 06: gradient accumulation, mixed precision, learning-rate schedule ---
    Mutant(
        id="06-no-sync-removed",
        file="06_ddp_in_practice/train.py",
        find="with contextlib.nullcontext() if i == len(micro_batches) - 1 else "
             "self.model.no_sync():",
        replace="with contextlib.nullcontext():",
        claim="no_sync saves all-reduces, one per optimizer step, and changes no math.",
        readme="06_ddp_in_practice/README.md#gradient-accumulation---accumulate-k-and-no_sync",
        tests=("tests/test_06_ddp_in_practice.py::test_no_sync_saves_all_reduces_not_math",),
    ),
    Mutant(
        id="06-loss-not-divided-by-k",
        file="06_ddp_in_practice/train.py",
        find="loss = F.cross_entropy(self.model(x), y) * len(y) / len(labels)",
        replace="loss = F.cross_entropy(self.model(x), y)",
        claim="K micro-batches of B take the steps of one batch of K*B.",
        readme="06_ddp_in_practice/README.md#gradient-accumulation---accumulate-k-and-no_sync",
        tests=("tests/test_06_ddp_in_practice.py::test_accumulation_equals_the_big_batch",),
    ),
    Mutant(
        id="06-lr-schedule-not-applied",
        file="06_ddp_in_practice/train.py",
        find='group["lr"] = self.lr_schedule(self.steps)',
        replace="lr = self.lr_schedule(self.steps)",
        claim="The rate warms up from --lr to the --scale-lr rate over --warmup-steps steps.",
        readme="06_ddp_in_practice/README.md"
               "#the-learning-rate-for-the-global-batch---scale-lr---warmup-steps",
        tests=("tests/test_06_ddp_in_practice.py::"
               "test_the_warm_up_and_the_scaled_rate_reach_the_optimizer",),
    ),
    Mutant(
        id="06-sqrt-rule-scales-linearly",
        file="06_ddp_in_practice/learning_rate.py",
        find='"sqrt": lr * math.sqrt(k)',
        replace='"sqrt": lr * k',
        claim="--scale-lr sqrt multiplies --lr by the square root of the global batch over 32.",
        readme="06_ddp_in_practice/README.md"
               "#the-learning-rate-for-the-global-batch---scale-lr---warmup-steps",
        tests=("tests/test_06_ddp_in_practice.py::test_scale_lr_gives_the_documented_rates",),
    ),
    Mutant(
        id="06-model-cast-to-bf16",
        file="06_ddp_in_practice/train.py",
        find="    model = WineMLP().to(device)\n",
        replace="    model = WineMLP().to(device, {'bf16': torch.bfloat16}.get(args.precision))\n",
        claim="Under autocast the weights, their gradients and Adam's state stay fp32.",
        readme="06_ddp_in_practice/README.md#mixed-precision---precision-bf16fp16",
        tests=("tests/test_06_ddp_in_practice.py::test_bf16_learns_and_stays_close_to_fp32",),
    ),
    Mutant(
        id="06-fp16-step-without-the-scaler",
        file="06_ddp_in_practice/train.py",
        find="self.scaler.step(self.optimizer)",
        replace="self.optimizer.step()",
        claim="fp16's GradScaler skips any step whose gradients overflowed.",
        readme="06_ddp_in_practice/README.md#mixed-precision---precision-bf16fp16",
        tests=("tests/test_06_ddp_in_practice.py::"
               "test_fp16_skips_the_step_whose_gradient_overflowed[cpu-gloo]",),
    ),
    # --- lesson 07: FSDP and sharded checkpoints ---
    Mutant(
        id="07-fsdp-wraps-only-the-root",
        file="07_sharding/sharding.py",
        find="    for layer in (model.fc1, model.fc2):\n        fully_shard(layer, mesh=mesh)\n"
             "    return fully_shard(model, mesh=mesh)",
        replace="    return fully_shard(model, mesh=mesh)",
        claim="FSDP gathers a layer whole only around its computation, never the whole model.",
        readme="07_sharding/README.md#the-same-steps-less-held",
        tests=("tests/test_07_sharding.py::test_fsdp_gathers_one_layer_at_a_time_never_the_model",),
    ),
    Mutant(
        id="07-ranks-seeded-apart",
        file="07_sharding/train.py",
        find="torch.manual_seed(args.seed)",
        replace="torch.manual_seed(args.seed + dist.get_rank())",
        claim="FSDP takes DDP's steps; it broadcasts no weights, so the ranks must seed alike.",
        readme="07_sharding/README.md#pitfalls",
        tests=("tests/test_07_sharding.py::"
               "test_sharded_training_takes_the_steps_of_ddp_and_of_one_process[fsdp]",),
    ),
    Mutant(
        id="07-resume-skips-an-epoch",
        file="07_sharding/train.py",
        find='trainer.epochs_completed = progress["epochs_completed"]',
        replace='trainer.epochs_completed = progress["epochs_completed"] + 1',
        claim="A crash and the same command again end bitwise equal to a run that never crashed.",
        readme="07_sharding/README.md#the-sharded-checkpoint",
        tests=("tests/test_07_sharding.py::"
               "test_a_crash_and_a_resume_end_bitwise_equal_to_a_run_that_never_crashed",),
    ),
    Mutant(
        id="07-unfinished-save-loaded",
        file="07_sharding/sharding.py",
        find='"epoch_*", "checksums.json")',
        replace='"epoch_*", "progress.json")',
        claim="A save cut short, without its checksums.json, is never loaded.",
        readme="07_sharding/README.md#the-sharded-checkpoint",
        tests=("tests/test_07_sharding.py::"
               "test_a_crash_and_a_resume_end_bitwise_equal_to_a_run_that_never_crashed",),
        kind="refactor",
    ),
    Mutant(
        id="07-adam-state-not-loaded",
        file="07_sharding/sharding.py",
        find="dcp.load(state, checkpoint_id=path)",
        replace='dcp.load({"model": state["model"]}, checkpoint_id=path)',
        claim="A checkpoint loads into another strategy and world size, Adam's state with it.",
        readme="07_sharding/README.md#the-sharded-checkpoint",
        tests=("tests/test_07_sharding.py::"
               "test_zero1s_checkpoint_loads_into_ddp_on_one_rank_and_trains_on",),
    ),
    Mutant(
        id="07-final-pt-holds-shards",
        file="07_sharding/train.py",
        find="StateDictOptions(full_state_dict=True,",
        replace="StateDictOptions(full_state_dict=False,",
        claim="final.pt holds the full weights, gathered from every rank's shards.",
        readme="07_sharding/README.md#the-sharded-checkpoint",
        tests=("tests/test_07_sharding.py::"
               "test_every_strategy_learns_and_writes_lesson_01s_weights[fsdp]",),
    ),
    Mutant(
        id="07-memory-counts-whole-tensors",
        file="07_sharding/memory.py",
        find="t.to_local() if isinstance(t, DTensor) else t for t in tensors",
        replace="t for t in tensors",
        claim="Each rank's memory table counts only its own shard of every sharded tensor.",
        readme="07_sharding/README.md#who-holds-what",
        tests=("tests/test_07_sharding.py::test_fsdp_holds_one_nth_of_everything[2]",),
        kind="refactor",
    ),
    Mutant(
        id="07-checksums-not-checked",
        file="07_sharding/guard_rails.py",
        find="    check_checksums(path)  # every file whole, as its save wrote it, before any is "
             "read",
        replace="    pass",
        claim="A shard with other bytes of its size is refused by its checksum, not loaded.",
        readme="07_sharding/README.md#the-sharded-checkpoint",
        tests=("tests/test_07_sharding.py::"
               "test_a_shard_with_other_bytes_of_its_size_is_refused_by_its_checksum",),
        kind="refactor",
    ),
    # --- lesson 08: DDP from scratch ---
    Mutant(
        id="08-after-backward-not-averaged",
        file="08_ddp_from_scratch/grad_sync.py",
        find="grad *= 1 / dist.get_world_size()",
        replace="pass",
        claim="Every home-made synchronisation ends on DDP's weights: the mean, not the sum.",
        readme="08_ddp_from_scratch/README.md#averaging-by-hand-after-backward",
        tests=("tests/test_08_ddp_from_scratch.py::test_every_mode_ends_on_ddps_weights[2]",),
    ),
    Mutant(
        id="08-overlap-forgets-to-divide",
        file="08_ddp_from_scratch/grad_sync.py",
        find="torch.mul(param.grad, 1 / dist.get_world_size(), out=slot)",
        replace="slot.copy_(param.grad)",
        claim="Overlap and buckets end on DDP's weights: each gradient times 1/N as it is copied.",
        readme="08_ddp_from_scratch/README.md#overlap-hooks-and-asynchronous-all-reduces",
        tests=("tests/test_08_ddp_from_scratch.py::test_every_mode_ends_on_ddps_weights[2]",),
    ),
    Mutant(
        id="08-no-broadcast-from-rank-0",
        file="08_ddp_from_scratch/grad_sync.py",
        find="    broadcast_from_rank_0(model)\n",
        replace="",
        claim="Every rank starts from rank 0's weights, as DDP's constructor makes them.",
        readme="08_ddp_from_scratch/README.md#averaging-by-hand-after-backward",
        tests=("tests/test_08_ddp_from_scratch.py::test_every_rank_starts_from_rank_0s_weights",),
    ),
    Mutant(
        id="08-buckets-in-forward-order",
        file="08_ddp_from_scratch/grad_sync.py",
        find="for name, param in reversed(list(model.named_parameters())):",
        replace="for name, param in model.named_parameters():",
        claim="Buckets fill in the order backward produces the gradients, as DDP's do.",
        readme="08_ddp_from_scratch/README.md#buckets-what-ddp-does",
        tests=("tests/test_08_ddp_from_scratch.py::"
               "test_bucket_sizes_follow_the_readmes_arithmetic[5-sizes1]",),
    ),
    # --- lesson 09: tensor parallelism and 2-D ---
    Mutant(
        id="09-row-wise-without-all-reduce",
        file="09_tensor_parallel/tensor_parallel.py",
        find="RowwiseParallel() if i % 2",
        replace="RowwiseParallel(output_layouts=dist.tensor.Partial()) if i % 2",
        claim="TP on 2 ranks takes one process's steps: a row-wise layer all-reduces its sums.",
        readme="09_tensor_parallel/README.md#column-wise-then-row-wise",
        tests=("tests/test_09_tensor_parallel.py::"
               "test_tensor_parallel_takes_the_steps_of_one_process",),
    ),
    Mutant(
        id="09-tp-ranks-read-apart",
        file="09_tensor_parallel/train.py",
        find='mesh["dp"].get_local_rank(), args.dp)  # by TP group',
        replace="rank, args.world_size)  # by TP group",
        claim="The ranks of a TP group read the same batches; dp groups read different ones.",
        readme="09_tensor_parallel/README.md#who-reads-what",
        tests=("tests/test_09_tensor_parallel.py::"
               "test_tensor_parallel_takes_the_steps_of_one_process",),
    ),
    Mutant(
        id="09-test-counts-summed-over-tp",
        file="09_tensor_parallel/train.py",
        find="dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.dp_group)",
        replace="dist.all_reduce(counts, op=dist.ReduceOp.SUM)",
        claim="Each test wine is counted once, by its dp group, not once per TP rank.",
        readme="09_tensor_parallel/README.md#who-reads-what",
        tests=("tests/test_09_tensor_parallel.py::test_2d_takes_the_steps_of_ddp_on_the_dp_ranks",),
        kind="refactor",
    ),
    Mutant(
        id="09-mesh-groups-along-the-wrong-dim",
        file="09_tensor_parallel/mesh.py",
        find="for line in ranks.movedim(dim, -1).reshape(-1, ranks.size(dim)):",
        replace="for line in ranks.reshape(-1, ranks.size(dim)):",
        claim="Row d of the mesh is TP group d; column t, the ranks that hold the same slices, is "
              "a dp group.",
        readme="09_tensor_parallel/README.md#2-d-fsdp-across-tp-groups",
        tests=("tests/test_09_tensor_parallel.py::test_2d_takes_the_steps_of_ddp_on_the_dp_ranks",),
        kind="refactor",
    ),
    Mutant(
        id="09-torch-warnings-shown",
        file="09_tensor_parallel/guard_rails.py",
        find='warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module',
        replace='warnings.filterwarnings("default", message=r"FSDP2-wrapped module',
        claim="A 2-D run prints the lesson's lines, not torch's warnings on what it never does.",
        readme="09_tensor_parallel/README.md#2-d-fsdp-across-tp-groups",
        tests=("tests/test_09_tensor_parallel.py::test_2d_takes_the_steps_of_ddp_on_the_dp_ranks",),
        kind="refactor",
    ),
    # --- lesson 10: pipeline parallelism ---
    Mutant(
        id="10-mean-loss-per-micro-batch",
        file="10_pipeline_parallel/train.py",
        find='reduction="sum") / self.real_rows',
        replace='reduction="mean")',
        claim="A micro-batch's loss is its share of the batch's mean: summed, over the batch's "
              "real rows.",
        readme="10_pipeline_parallel/README.md#a-short-last-batch-and-the-loss-of-a-micro-batch",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_unequal_micro_batches_need_the_batchs_mean_not_torchs_default",),
    ),
    Mutant(
        id="10-1f1b-is-gpipe",
        file="10_pipeline_parallel/pipeline.py",
        find='"1f1b": Schedule1F1B',
        replace='"1f1b": ScheduleGPipe',
        claim="1F1B runs p - s forwards, then a backward and a forward in turn: p - s held.",
        readme="10_pipeline_parallel/README.md#the-library-pipelinestage-and-a-schedule",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_each_rank_runs_the_order_its_schedule_defines[1f1b]",),
        kind="refactor",
    ),
    Mutant(
        id="10-afab-backwards-reversed",
        file="10_pipeline_parallel/pipeline.py",
        find="for x, out in zip(inputs, outputs, strict=True):",
        replace="for x, out in zip(inputs[::-1], outputs[::-1], strict=True):",
        claim="afab by hand runs GPipe's order and ends on its weights to the last bit.",
        readme="10_pipeline_parallel/README.md#by-hand-all-forwards-then-all-backwards",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_the_schedules_change_the_order_not_the_sums[4]",),
    ),
    Mutant(
        id="10-pipelines-not-averaged",
        file="10_pipeline_parallel/train.py",
        find="            average_gradients(self.stages, self.dp_group)",
        replace="            pass",
        claim="--dp pipelines average each layer's gradients over their copies: DDP's steps.",
        readme="10_pipeline_parallel/README.md#dp--pp-several-pipelines",
        tests=("tests/test_10_pipeline_parallel.py::test_dp_pipelines_take_the_steps_of_ddp",),
    ),
    Mutant(
        id="10-layers-not-checked",
        file="10_pipeline_parallel/guard_rails.py",
        find="if linears % pieces:",
        replace="if False:",
        claim="Layers that do not split evenly over the stages are refused in one line.",
        readme="10_pipeline_parallel/README.md#pitfalls",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_layers_that_do_not_split_over_the_stages_get_one_line",),
        kind="refactor",
    ),
    Mutant(
        id="10-clock-before-the-stream",
        file="10_pipeline_parallel/timeline.py",
        find='if tensor.device.type == "cuda":',
        replace="if False:",
        claim="On a GPU each simulated layer's clock starts once its stream has the input.",
        readme="10_pipeline_parallel/README.md#the-bubble-measured",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_the_simulated_clock_starts_when_the_gpus_stream_has_the_input",),
    ),
    Mutant(
        id="10-w-dropped",
        file="10_pipeline_parallel/split_backward.py",
        find="    for _ in range(weights):",
        replace="    for _ in range(weights - 1):",
        claim="B then W, by hand, give the gradients of one ordinary backward to the last bit.",
        readme="10_pipeline_parallel/README.md#zero-bubble-the-backward-split-in-two",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_b_then_w_by_hand_add_up_to_one_backward_and_the_controls_do_not",),
    ),
    Mutant(
        id="10-w-run-twice",
        file="10_pipeline_parallel/split_backward.py",
        find="            param.grad = g if param.grad is None else param.grad + g",
        replace="            param.grad = 2 * g if param.grad is None else param.grad + 2 * g",
        claim="W adds each layer's weight gradient once, as one backward adds it.",
        readme="10_pipeline_parallel/README.md#zero-bubble-the-backward-split-in-two",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_b_then_w_by_hand_add_up_to_one_backward_and_the_controls_do_not",),
    ),
    Mutant(
        id="10-b-not-handed-back",
        file="10_pipeline_parallel/split_backward.py",
        find="    return dx, douts",
        replace="    return torch.zeros_like(dx), douts",
        claim="B hands the stage before the gradient of this stage's input, the one backward's.",
        readme="10_pipeline_parallel/README.md#zero-bubble-the-backward-split-in-two",
        tests=("tests/test_10_pipeline_parallel.py::"
               "test_b_then_w_by_hand_add_up_to_one_backward_and_the_controls_do_not",),
    ),
    # --- lesson 11: context parallelism, ring attention ---
    Mutant(
        id="11-blocks-averaged-not-merged",
        file="11_context_parallel/ring_attention.py",
        find="(lse - new_lse).exp() * out + (block_lse - new_lse).exp() * block_out",
        replace="(out + block_out) / 2",
        claim="Blocks of attention combine by their log-sum-exp: exactly the softmax over both.",
        readme="11_context_parallel/README.md#ring-attention",
        tests=("tests/test_11_context_parallel.py::test_merge_is_the_softmax_over_both_blocks_keys",
               "tests/test_11_context_parallel.py::"
               "test_ring_and_all_gather_attention_equal_full_attention"),
    ),
    Mutant(
        id="11-later-chunks-not-masked",
        file="11_context_parallel/ring_attention.py",
        find="    if k_chunk > q_chunk:\n        return None",
        replace="    if False:\n        return None",
        claim="Causal attention across chunks: no query sees a later chunk's keys.",
        readme="11_context_parallel/README.md#ring-attention",
        tests=("tests/test_11_context_parallel.py::"
               "test_ring_and_all_gather_attention_equal_full_attention",),
    ),
    Mutant(
        id="11-gradients-not-summed",
        file="11_context_parallel/gradients.py",
        find="    dist.all_reduce(flat, group=group)",
        replace="    pass",
        claim="Every layout takes one process's steps: each rank's share of the gradient summed.",
        readme="11_context_parallel/README.md#equal-to-one-process",
        tests=("tests/test_11_context_parallel.py::"
               "test_every_layout_takes_the_steps_of_one_process[cp2]",),
    ),
    Mutant(
        id="11-positions-counted-from-0-on-every-rank",
        file="11_context_parallel/train.py",
        find="                for t in (inputs, targets, positions)]",
        replace="                for t in (inputs, targets)]"
                " + [positions[:len(positions) // self.cp]]",
        claim="Each rank embeds its tokens' positions in the whole sequence.",
        readme="11_context_parallel/README.md#who-holds-which-tokens",
        tests=("tests/test_11_context_parallel.py::"
               "test_every_layout_takes_the_steps_of_one_process[cp2]",),
    ),
    Mutant(
        id="11-own-chunk-skipped",
        file="11_context_parallel/ring_attention.py",
        find="    if k_chunk > q_chunk:\n        return None",
        replace="    if k_chunk >= q_chunk:\n        return None",
        claim="A rank computes the blocks the causal mask leaves it (keys not after its queries).",
        readme="11_context_parallel/README.md#who-holds-which-tokens",
        tests=("tests/test_11_context_parallel.py::"
               "test_the_balanced_layout_gives_every_rank_the_same_blocks",),
    ),
    Mutant(
        id="11-chunks-r-and-n-plus-r",
        file="11_context_parallel/ring_attention.py",
        find="return [rank, 2 * cp - 1 - rank] if balanced",
        replace="return [rank, cp + rank] if balanced",
        claim="Rank r holds chunks r and 2N - 1 - r, so that every rank has the same work.",
        readme="11_context_parallel/README.md#who-holds-which-tokens",
        tests=("tests/test_11_context_parallel.py::test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r",
               "tests/test_11_context_parallel.py::"
               "test_the_balanced_layout_gives_every_rank_the_same_blocks"),
    ),
    Mutant(
        id="11-ring-waits-before-it-attends",
        file="11_context_parallel/ring_attention.py",
        find="attends to them\n                next_kv = ring_pass(kv, group)\n",
        replace="attends to them\n                next_kv = ring_pass(kv, group)\n"
                "                next_kv()\n",
        claim="The ring attends to the block it holds while the next one travels.",
        readme="11_context_parallel/README.md#ring-attention",
        tests=("tests/test_11_context_parallel.py::"
               "test_ring_and_all_gather_attention_equal_full_attention",),
        kind="refactor",
    ),
    Mutant(
        id="11-sent-blocks-kept-until-the-next-pass",
        file="11_context_parallel/ring_attention.py",
        find="        while works:  # the sends too; each let go once done, and with it the "
             "block it sent\n            works.pop().wait()",
        replace="        for work in works:\n            work.wait()",
        claim="In forward a rank holds two of the others' blocks: the one it uses, and the next.",
        readme="11_context_parallel/README.md#ring-attention",
        tests=("tests/test_11_context_parallel.py::"
               "test_ring_and_all_gather_attention_equal_full_attention",),
        kind="refactor",
    ),
    Mutant(
        id="11-a-batch-with-no-step-let-through",
        file="11_context_parallel/guard_rails.py",
        find="    if train // args.dp < args.batch_size // args.dp:",
        replace="    if False:",
        claim="A --batch-size that leaves a group no step stops in one line, before any rank.",
        readme="11_context_parallel/README.md#the-data-and-the-global-batch",
        tests=("tests/test_11_context_parallel.py::"
               "test_a_flag_that_cannot_work_stops_in_one_line[batch500]",),
    ),
    Mutant(
        id="11-dp-from-the-gpus-alone",
        file="11_context_parallel/guard_rails.py",
        find="if args.batch_size % d == 0),",
        replace="),",
        claim="Without --dp, the most CP groups of GPUs that --batch-size splits over.",
        readme="11_context_parallel/README.md#the-checkpoint-and-torchrun",
        tests=("tests/test_11_context_parallel.py::"
               "test_without_dp_the_most_cp_groups_of_gpus_that_the_batch_splits_over",),
        kind="refactor",
    ),
    # --- lesson 12: expert parallelism ---
    Mutant(
        id="12-router-weights-not-applied",
        file="12_expert_parallel/experts.py",
        find="index_add(0, token, y * weight[:, None])",
        replace="index_add(0, token, y)",
        claim="Each token gets its experts' outputs times the router's weights.",
        readme="12_expert_parallel/README.md#dispatch-and-combine",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_moe_by_hand_equals_every_expert_on_every_token",),
    ),
    Mutant(
        id="12-results-sent-back-in-the-wrong-order",
        file="12_expert_parallel/experts.py",
        find="exchange(outputs[by_expert.argsort()], receive, send, group)",
        replace="exchange(outputs, receive, send, group)",
        claim="An expert's rank sends each result back in the order its row arrived.",
        readme="12_expert_parallel/README.md#dispatch-and-combine",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_moe_by_hand_equals_every_expert_on_every_token",),
    ),
    Mutant(
        id="12-combined-in-the-unsorted-order",
        file="12_expert_parallel/experts.py",
        find="token, expert, weight = token[order], expert[order], weight[order]",
        replace="expert, weight = expert[order], weight[order]",
        claim="Each result is added to the token it was computed for.",
        readme="12_expert_parallel/README.md#dispatch-and-combine",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_moe_by_hand_equals_every_expert_on_every_token",),
    ),
    Mutant(
        id="12-capacity-not-applied",
        file="12_expert_parallel/experts.py",
        find="    if capacity is None:\n        return torch.ones_like(chosen, dtype=torch.bool)",
        replace="    if True:\n        return torch.ones_like(chosen, dtype=torch.bool)",
        claim="An expert takes at most its capacity of each sequence's choices, the same on "
              "every layout.",
        readme="12_expert_parallel/README.md#load-capacity-and-balance",
        tests=("tests/test_12_expert_parallel.py::"
               "test_a_capacity_limit_drops_the_same_choices_on_every_layout",),
    ),
    Mutant(
        id="12-gradients-outside-the-experts-not-summed",
        file="12_expert_parallel/train.py",
        find="        sum_gradients(self.dense, None)",
        replace="        pass",
        claim="The weights outside the experts are every rank's: their gradients summed over all.",
        readme="12_expert_parallel/README.md#equal-to-one-process",
        tests=("tests/test_12_expert_parallel.py::"
               "test_every_layout_takes_the_steps_of_one_process[ep2]",),
    ),
    Mutant(
        id="12-expert-gradients-not-summed-over-copies",
        file="12_expert_parallel/train.py",
        find="        sum_gradients(self.experts, self.mesh[\"dp\"].get_group())",
        replace="        pass",
        claim="With --dp 2, each expert's gradient is summed over the ranks that hold a copy.",
        readme="12_expert_parallel/README.md#equal-to-one-process",
        tests=("tests/test_12_expert_parallel.py::"
               "test_every_layout_takes_the_steps_of_one_process[dp2ep2]",),
    ),
    Mutant(
        id="12-top-k-weights-not-rescaled",
        file="12_expert_parallel/experts.py",
        find="        weights = weights / weights.sum(dim=-1, keepdim=True)",
        replace="        pass",
        claim="With k > 1 a token's weights are its chosen experts' probabilities, rescaled to "
              "sum to 1.",
        readme="12_expert_parallel/README.md#the-mixture-of-experts",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_routers_weights_are_its_top_k_probabilities_rescaled_to_sum_to_1",),
    ),
    Mutant(
        id="12-top-1-weight-set-to-1",
        file="12_expert_parallel/experts.py",
        find="    if top_k > 1:",
        replace="    if top_k >= 1:",
        claim="With k = 1 a token's weight is the router's probability itself, so the loss "
              "reaches the router.",
        readme="12_expert_parallel/README.md#the-mixture-of-experts",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_routers_weights_are_its_top_k_probabilities_rescaled_to_sum_to_1",),
    ),
    Mutant(
        id="12-balance-loss-counts-first-choices-only",
        file="12_expert_parallel/experts.py",
        find="F.one_hot(chosen, experts).to(probs.dtype)",
        replace="F.one_hot(chosen[..., :1], experts).to(probs.dtype)",
        claim="The balance loss is experts x the sum over experts of (its share of the "
              "sequence's choices) x (its mean probability).",
        readme="12_expert_parallel/README.md#load-capacity-and-balance",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_balance_loss_is_the_switch_transformers_per_sequence",),
    ),
    Mutant(
        id="12-balance-loss-without-the-experts-factor",
        file="12_expert_parallel/experts.py",
        find="    return experts * (share * probs.mean(dim=1)).sum()",
        replace="    return (share * probs.mean(dim=1)).sum()",
        claim="The balance loss is 1 when every expert gets its share of the choices.",
        readme="12_expert_parallel/README.md#load-capacity-and-balance",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_balance_loss_is_the_switch_transformers_per_sequence",),
    ),
    Mutant(
        id="12-capacity-one-short",
        file="12_expert_parallel/experts.py",
        find="    return (place <= capacity).view_as(chosen)",
        replace="    return (place < capacity).view_as(chosen)",
        claim="An expert takes the first capacity of its choices in each sequence, "
              "ceil(F x tokens x k / experts).",
        readme="12_expert_parallel/README.md#load-capacity-and-balance",
        tests=("tests/test_12_expert_parallel.py::"
               "test_an_expert_takes_the_first_capacity_of_its_choices_in_each_sequence",),
    ),
    Mutant(
        id="12-load-counts-the-dropped-choices",
        file="12_expert_parallel/experts.py",
        find="        self.load = counts.detach()",
        replace="        self.load = torch.bincount(chosen.flatten(), minlength=self.num_experts)",
        claim="The load recorded is the rows each expert got, the choices it took.",
        readme="12_expert_parallel/README.md#load-capacity-and-balance",
        tests=("tests/test_12_expert_parallel.py::test_each_experts_load_is_the_rows_it_ran",),
    ),
    Mutant(
        id="12-busiest-rank-is-its-busiest-expert",
        file="12_expert_parallel/experts.py",
        find="    per_rank = per_expert.view(len(per_expert), args.ep, -1).sum(dim=2)",
        replace="    per_rank = per_expert",
        claim="Each epoch's line names the busiest rank: the rows of its experts together.",
        readme="12_expert_parallel/README.md#load-capacity-and-balance",
        tests=("tests/test_12_expert_parallel.py::"
               "test_the_load_line_names_the_busiest_expert_and_the_busiest_rank",),
    ),
    # --- lesson 13: FSDP x TP x PP on one mesh ---
    Mutant(
        id="13-clipped-by-each-stages-norm",
        file="13_capstone/parallelize.py",
        find="    dist.all_reduce(squared, group=pp_group)\n",
        replace="",
        claim="Every stage is clipped by the whole model's gradient norm, not its own.",
        readme="13_capstone/README.md#composing-the-pieces",
        tests=(PROVE_13,),
    ),
    Mutant(
        id="13-positions-split-by-their-dim-1",
        file="13_capstone/parallelize.py",
        find="output_layouts=Shard(0))",
        replace="output_layouts=sequence)",
        claim="Under sequence parallelism each rank adds the positions of its own tokens.",
        readme="13_capstone/README.md#composing-the-pieces",
        tests=(PROVE_13,),
    ),
    Mutant(
        id="13-loss-over-the-global-batch",
        file="13_capstone/train.py",
        find="    tokens = args.batch_size // args.dp * args.seq_len",
        replace="    tokens = args.batch_size * args.seq_len",
        claim="Each dp rank divides by its own tokens; FSDP's average makes the global mean.",
        readme="13_capstone/README.md#composing-the-pieces",
        tests=(PROVE_13,),
    ),
    Mutant(
        id="13-blocks-dealt-round-robin",
        file="13_capstone/parallelize.py",
        find="        if int(name) // per_stage != stage:",
        replace="        if int(name) % stages != stage:",
        claim="Each stage keeps consecutive blocks, in the model's order.",
        readme="13_capstone/README.md#composing-the-pieces",
        tests=("tests/test_13_capstone.py::"
               "test_each_stage_keeps_consecutive_blocks_in_the_models_order",),
    ),
    Mutant(
        id="13-fsdp-blocks-kept-gathered",
        file="13_capstone/parallelize.py",
        find="        fully_shard(block, mesh=dp_mesh)\n",
        replace="        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)\n",
        claim="FSDP gathers each block just before each of its forwards, alone, and frees it "
              "after.",
        readme="13_capstone/README.md#equal-to-one-process",
        tests=(PROVE_13,),
        kind="refactor",
    ),
    Mutant(
        id="13-fsdp-blocks-one-unit",
        file="13_capstone/parallelize.py",
        find="        fully_shard(block, mesh=dp_mesh)\n",
        replace="        pass\n",
        claim="FSDP gathers each block just before each of its forwards, alone, and frees it "
              "after.",
        readme="13_capstone/README.md#equal-to-one-process",
        tests=(PROVE_13,),
    ),
    Mutant(
        id="13-mesh-dp-outermost",
        file="13_capstone/parallelize.py",
        find='DIMENSIONS = ("pp", "dp", "tp")',
        replace='DIMENSIONS = ("dp", "pp", "tp")',
        claim="On 2 nodes of 4 GPUs each stage of 2 x 2 x 2 is one node: only the pipeline "
              "crosses between nodes.",
        readme="13_capstone/README.md#the-mesh",
        tests=("tests/test_13_capstone.py::"
               "test_on_two_nodes_of_4_each_stage_is_a_node_and_only_the_pipeline_crosses",),
    ),
    Mutant(
        id="13-mesh-groups-without-the-timeout",
        file="13_capstone/parallelize.py",
        find="dist.new_group(line.tolist(), timeout=datetime.timedelta(seconds=timeout))",
        replace="dist.new_group(line.tolist())",
        claim="Each group of the mesh waits --timeout for a rank that stalls.",
        readme="13_capstone/README.md#the-mesh",
        tests=("tests/test_13_capstone.py::"
               "test_every_group_of_the_mesh_waits_the_timeout_it_is_given",),
        kind="refactor",
    ),
    Mutant(
        id="13-default-dp-ignores-the-batch",
        file="13_capstone/guard_rails.py",
        find="                       if args.batch_size % (d * args.microbatches) == 0), "
             "default=1)",
        replace="                       if True), default=1)",
        claim="Without --dp, the GPUs hold the most pipelines that --batch-size splits over.",
        readme="13_capstone/README.md#the-checkpoint-restarts-and-two-nodes",
        tests=("tests/test_13_capstone.py::"
               "test_without_dp_the_gpus_hold_the_most_pipelines_the_batch_splits_over",),
    ),
    Mutant(
        id="13-schedule-scales-the-gradients",
        file="13_capstone/parallelize.py",
        find="loss_fn=loss_fn, scale_grads=False)",
        replace="loss_fn=loss_fn)",
        claim="The loss is divided by the tokens once; the schedule adds the micro-batches.",
        readme="13_capstone/README.md#composing-the-pieces",
        tests=(PROVE_13,),
    ),
    Mutant(
        id="09-nodes-backends-not-compared",
        file="09_tensor_parallel/guard_rails.py",
        find="    if len(set(chosen)) > 1:",
        replace="    if False:",
        claim="Nodes that chose different backends stop in one line.",
        readme="09_tensor_parallel/README.md#torchrun-on-one-machine-or-several",
        tests=("tests/test_09_tensor_parallel.py::"
               "test_nodes_that_chose_different_backends_stop_in_one_line",),
        kind="refactor",
    ),
    # --- lesson 14: any rank measured on fake tensors; the planner; three published tables ---
    Mutant(
        id="14-saved-bytes-count-the-weights",
        file="14_planning/measure.py",
        find="if not isinstance(base, torch.nn.Parameter) and name not in self.seen:",
        replace="if name not in self.seen:",
        claim="The activations are what autograd saves for backward, the weights excluded: "
              "Korthikanti et al.'s Table 2 to the byte.",
        readme="14_planning/README.md#korthikanti-et-als-table-2-to-the-byte",
        tests=("tests/test_14_planning.py::test_korthikanti_table_2_to_the_byte_and_its_controls",),
    ),
    Mutant(
        id="14-dropout-as-the-cpu-keeps-it",
        file="14_planning/fake_ranks.py",
        find='    with mock.patch.object(F, "dropout", dropout), mock.patch.object(',
        replace="    with mock.patch.object(",
        claim="The fake tensors claim the CPU, and dropout saves a GPU's one-byte mask.",
        readme="14_planning/README.md#how-a-rank-is-built-without-its-memory",
        tests=("tests/test_14_planning.py::test_korthikanti_table_2_to_the_byte_and_its_controls",),
    ),
    Mutant(
        id="14-fsdp-never-kept-gathered",
        file="14_planning/prove_zero.py",
        find='reshard_after_forward=way == "FSDP2"',
        replace="reshard_after_forward=True",
        claim="FSDP2 not resharded after forward holds the bf16 weights from forward to backward: "
              "ZeRO-2's counterpart.",
        readme="14_planning/README.md#the-zero-papers-figure-1",
        tests=("tests/test_14_planning.py::test_zero_figure_1_to_the_byte_and_its_control",),
    ),
    Mutant(
        id="14-fsdp-gathers-in-float32",
        file="14_planning/fake_ranks.py",
        find="MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
        replace="MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)",
        claim="A rank computes in bf16 from FSDP's float32 shards: Korthikanti et al.'s 16-bit "
              "activations, to the byte.",
        readme="14_planning/README.md#korthikanti-et-als-table-2-to-the-byte",
        tests=("tests/test_14_planning.py::test_korthikanti_table_2_to_the_byte_and_its_controls",),
    ),
    Mutant(
        id="14-gradients-reduced-every-micro-batch",
        file="14_planning/fake_ranks.py",
        find="model.set_requires_gradient_sync(i == len(pairs) - 1)",
        replace="model.set_requires_gradient_sync(True)",
        claim="A step's collectives, calls and bytes, are lesson 13's: FSDP reduces in the last "
              "backward only, as torch's pipeline schedules have it.",
        readme="14_planning/README.md#the-planner-proven-honest",
        tests=("tests/test_14_planning.py::"
               "test_a_steps_collectives_are_lesson_13s_calls_and_bytes",),
    ),
    Mutant(
        id="14-the-ends-counted-for-every-block",
        file="14_planning/plan.py",
        find="one + (blocks - 1) * (value(runs[-1]) - one)",
        replace="blocks * one",
        claim="A stage built with one block and with two gives what the whole stage holds: "
              "lesson 13's real run's bytes per rank.",
        readme="14_planning/README.md#the-planner-proven-honest",
        tests=("tests/test_14_planning.py::test_each_stage_holds_what_lesson_13s_real_run_held",),
    ),
    Mutant(
        id="14-stages-not-balanced",
        file="14_planning/plan.py",
        find="[per - 1] + [per] * (pp - 2) + [per - 1] if",
        replace="[per] * pp if",
        claim="126 blocks on 16 stages: one block fewer on the first and the last, as Llama 3.",
        readme="14_planning/README.md#how-a-rank-is-built-without-its-memory",
        tests=("tests/test_14_planning.py::"
               "test_the_rule_tries_no_recomputation_first_then_fewer_cp_then_fewer_stages",),
    ),
    Mutant(
        id="14-exercise-tp-across-nodes",
        file="exercises/check_plan.py",
        find="    if tp > 8:",
        replace="    if tp > 16:",
        claim="Exercise 14's checker refuses a TP group across nodes.",
        readme="14_planning/README.md#the-rule-and-what-it-tries",
        tests=("tests/test_14_planning.py::test_exercise_14_names_what_is_wrong_before_measuring",),
    ),
    Mutant(
        id="14-1f1b-holds-every-micro-batch",
        file="14_planning/plan.py",
        find='in_flight = m if layout.schedule == "gpipe" else min(m, layout.pp - stage)',
        replace="in_flight = m",
        claim="Under 1F1B stage s of p holds p - s micro-batches' activations, not all m.",
        readme="14_planning/README.md#what-a-rank-holds",
        tests=("tests/test_14_planning.py::"
               "test_under_1f1b_a_stage_holds_pp_minus_stage_micro_batches",),
    ),
]
