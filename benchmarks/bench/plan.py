"""What a run measures: every case, grouped by the world size whose ranks run it, one planner
per family of cases, and the cases left out with the reason."""

from bench.cases import tensor_layout
from bench.flags import HIDDEN, TENSOR_PARALLEL, TP_2D, TWO_CHUNKS


def plan_cases(args, device_type, cores):
    """Every measurement, grouped by the world size whose ranks run it.

    Returns ({world_size: [case]}, backend, skipped), where skipped lists the cases left out
    because they would measure nothing, each with the reason."""
    plan = Plan(args, device_type, cores)
    noise_case = plan_models(plan)
    plan_knobs(plan)
    plan_grad_sync(plan)
    plan_allreduce(plan)
    plan_pipeline(plan)
    # The noise check's case, measured in the last launch (the longest, where the per-worker
    # cases and the knobs are), before its rounds and again after them, its other ranks waiting:
    # in one process, because the same case measured in two launches can differ by several per
    # cent by itself (benchmarks/README.md): the launches differ in the other cases each
    # process holds and runs.
    top = args.max_world_size
    plan.cases[top] = [{**noise_case, "noise_check": "start"}, *plan.cases[top],
                       {**noise_case, "noise_check": "end"}]
    index = 0
    for cases in plan.cases.values():
        for case in cases:
            index += 1
            case["index"] = index
    return ({world_size: cases for world_size, cases in plan.cases.items() if cases},
            plan.backend, plan.skipped)


class Plan:
    """The cases planned so far ({world size: [case]}) and those left out (skipped, one line
    each), with what every case shares: the flags, the device, the backend, the cores."""

    def __init__(self, args, device_type, cores):
        self.args, self.device_type, self.cores = args, device_type, cores
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        self.top = args.max_world_size
        self.world_sizes = range(1, self.top + 1)
        self.cases = {world_size: [] for world_size in self.world_sizes}
        self.skipped = []

    def training(self, model, case, world_size, threads=None, batch=None, knob=None,
                 value=None, accumulate=1, run_in=None):
        """Add a training case, to the launch of its own world size or of run_in."""
        args = self.args
        batch = batch or args.batch_size
        # The ranks that read batches of their own: all of them, but for tp and 2d only one rank
        # per TP group (dp of them), since the ranks of a TP group read the same batch and
        # compute one step of one model together. Its samples/s counts that batch once.
        readers = (tensor_layout(case, world_size)[0] if case in TENSOR_PARALLEL
                   else world_size)
        steps = args.steps if model == "resnet18" else args.mlp_steps
        images = model == "resnet18"
        case = {
            "case": case, "model": model, "knob": knob,
            "knob_value": None if value is None else str(value), "world_size": world_size,
            "backend": self.backend, "device": self.device_type,
            # The ranks share the cores evenly, so that more ranks do not simply mean more
            # threads than cores fighting each other. 1 rank gets every core.
            "threads_per_rank": threads or max(1, self.cores // world_size),
            "batch_per_rank": batch, "global_batch": batch * readers, "accumulate": accumulate,
            # no_sync runs at least as many forward/backward passes as the others, in fewer
            # optimizer steps.
            "steps": -(-steps // accumulate) * accumulate, "warmup": args.warmup,
            # bf16 and channels_last are for ResNet-18's images; the MLP measures DDP's fixed
            # cost per step, in fp32 everywhere.
            "image_size": args.image_size if images else None,
            "precision": args.precision if images else "fp32",
            # FSDP2 cannot shard channels_last parameters: fully_shard raises "FSDP does not
            # support non-contiguous parameters yet" (torch 2.14; tools/repro_fsdp_channels_last.py,
            # pytorch/pytorch#137382), so its rows keep the default layout, and say so.
            "channels_last": args.channels_last and images and case != "fsdp",
        }
        self.cases[run_in or world_size].append(case)
        return case

    def knob_model(self):
        """The model the knobs and lesson 08's modes run on: ResNet-18 if measured."""
        return "resnet18" if "resnet18" in self.args.models else self.args.models[0]


def plan_models(plan):
    """Each model: plain, DDP, lesson 07's strategies and lesson 09's layouts at every world
    size; on the CPU one process with every core and the per-worker cases, on GPUs
    DataParallel. Returns the noise check's case: the plain model in one process with every
    core, so that another program on any core slows it (ResNet-18's, if measured)."""
    args, top, world_sizes = plan.args, plan.top, plan.world_sizes
    noise_model = plan.knob_model()
    for model in args.models:
        plain = plan.training(model, "plain", 1)
        if model == noise_model:
            noise_case = plain
        for world_size in world_sizes:
            plan.training(model, "ddp", world_size)
            # Lesson 07's sharded strategies, on the same ranks, threads and batch as DDP.
            for strategy in args.sharded:
                plan.training(model, strategy, world_size)
            # Lesson 09's layouts, on the same ranks, threads and batch per rank, where the
            # world size has the layout (tensor_parallel_sizes).
            for layout in args.tensor_parallel if model == "wine-mlp" else []:
                if world_size in tensor_parallel_sizes(layout, top):
                    plan.training(model, layout, world_size)
        if plan.device_type == "cpu":
            # One process with every core and the largest DDP run's global batch: the same work
            # per step, without DDP. On a laptop this is the number to beat.
            plan.training(model, "single-process-all-cores", 1, threads=plan.cores,
                          batch=args.batch_size * top)
            # Every rank with the same few threads, 1 rank as well as N: what DDP scales, each
            # rank bringing its own cores, as each GPU does. Efficiency = samples/s of N ranks
            # / (N x samples/s of 1 rank). Its ceiling: N plain processes at once, each with
            # the same threads and batch, that never communicate; their summed samples/s is
            # what N workers can reach on this machine (shared memory bandwidth, caches,
            # turbo), whatever DDP does. All of them run in the N-rank launch, interleaved.
            if top > 1:
                for world_size in world_sizes:
                    for case in ("ddp-per-worker", "ceiling"):
                        plan.training(model, case, world_size,
                                      threads=args.threads_per_worker, run_in=top)
        else:
            # One process drives `gpus` GPUs, so it runs with the single-rank group; its
            # world_size column counts GPUs, to line it up with DDP on as many. On one GPU,
            # DataParallel calls the model itself (no replica, no thread): no measurement.
            for gpus in world_sizes[1:]:
                plan.training(model, "dataparallel", gpus, threads=plan.cores, run_in=1)
    skip_what_one_rank_cannot_show(plan)
    return noise_case


def skip_what_one_rank_cannot_show(plan):
    """plan_models' cases left out: at 1 rank, or where a layout does not fit."""
    args, top = plan.args, plan.top
    if plan.device_type == "cpu" and top == 1:
        plan.skipped.append("per-worker scaling (ddp-per-worker): it compares 1 rank with N; "
                            "use --max-world-size 2 or more")
    if plan.device_type == "cuda" and top == 1:
        plan.skipped.append("nn.DataParallel: on one GPU it calls the model itself, so it "
                            "would only repeat the plain model; it needs 2 or more GPUs")
    if args.tensor_parallel and "resnet18" in args.models:
        plan.skipped.append(f"resnet18 {', '.join(args.tensor_parallel)}: lesson 09's plan "
                            "splits Linear layers (fc1 column-wise, fc2 row-wise), not "
                            "convolutions; ResNet-18 has no tensor-parallel case")
    for layout in args.tensor_parallel if "wine-mlp" in args.models else []:
        left_out = [n for n in plan.world_sizes if n not in tensor_parallel_sizes(layout, top)]
        if left_out:
            sizes = ", ".join(map(str, left_out))
            why = (f"one TP group of every rank needs 2 or more ranks that divide fc1's "
                   f"{HIDDEN} hidden units" if layout == "tp" else
                   f"dp x tp with tp = {TP_2D} needs an even world size of 4 or more"
                   + ("; use --max-world-size 4" if top < 4 else ""))
            plan.skipped.append(f"wine-mlp {layout} at world size(s) {sizes}: {why}")
    if args.sharded and top == 1:
        plan.skipped.append(f"nothing to shard over ({', '.join(args.sharded)} run, but with 1 "
                            "rank they hold what DDP holds); use --max-world-size 2 or more to "
                            "see 1/N")


def plan_knobs(plan):
    """DDP's knobs, each on its own, at the largest world size."""
    args, top = plan.args, plan.top
    if args.knobs and top == 1:
        plan.skipped.append(f"DDP knobs ({', '.join(args.knobs)}): they change how ranks "
                            "exchange gradients, and one rank exchanges nothing; they need 2 or "
                            "more ranks")
    for knob in args.knobs if top > 1 else []:
        if knob == "bucket_cap_mb":
            for megabytes in (1, 100):
                plan.training(plan.knob_model(), "ddp", top, knob=knob, value=megabytes)
        elif knob == "no_sync":
            plan.training(plan.knob_model(), "ddp", top, knob=knob, value=args.accumulate,
                          accumulate=args.accumulate)
        else:
            plan.training(plan.knob_model(), "ddp", top, knob=knob, value=True)


def plan_grad_sync(plan):
    """Lesson 08's modes, each rank with the per-worker threads on the CPU, side by side with
    ddp-per-worker and the ceiling in the same launch."""
    args, top = plan.args, plan.top
    if args.grad_sync and top == 1:
        plan.skipped.append(f"lesson 08's --grad-sync ({', '.join(args.grad_sync)}): one rank "
                            "has no gradients to average with; it needs 2 or more ranks")
    for mode in args.grad_sync if top > 1 else []:
        plan.training(plan.knob_model(), "lesson08", top, knob="grad_sync", value=mode,
                      threads=args.threads_per_worker if plan.device_type == "cpu" else None)


def plan_allreduce(plan):
    """The all-reduce bandwidth, only where a link is crossed, at 2+ ranks: with one rank an
    all-reduce copies nothing anywhere. On GPUs NCCL and gloo on the same GPU tensors."""
    backends = ["nccl", "gloo"] if plan.device_type == "cuda" else ["gloo"]
    if plan.top == 1:
        plan.skipped.append("all-reduce bandwidth: one rank has no one to exchange with; it "
                            "needs 2 or more ranks"
                            + (" (GPUs)" if plan.device_type == "cuda" else ""))
    for world_size in plan.world_sizes[1:]:
        for backend in backends:
            for size in plan.args.allreduce_sizes:
                plan.cases[world_size].append({
                    "case": "allreduce", "backend": backend, "device": plan.device_type,
                    "world_size": world_size, "size_bytes": size,
                    "iters": plan.args.allreduce_iters, "warmup": 2,
                    "threads_per_rank": max(1, plan.cores // world_size)})


def plan_pipeline(plan):
    """Lesson 10's schedules at every world size p of 2 or more where they fit, each in the
    p-rank launch beside one process running the same micro-batches in turn (the other ranks
    waiting), with the same threads per rank; each simulated and not."""
    args = plan.args
    if args.pipeline and plan.top == 1:
        plan.skipped.append(f"pipeline ({', '.join(args.pipeline)}): one rank holds the whole "
                            "model, a pipeline of one stage; it needs 2 or more ranks")
    for world_size in plan.world_sizes[1:] if args.pipeline else []:
        fits = [s for s in args.pipeline if not pipeline_problem(s, world_size, args)]
        reasons = {}  # the schedules left out, by reason
        for schedule in (s for s in args.pipeline if s not in fits):
            reasons.setdefault(pipeline_problem(schedule, world_size, args), []).append(schedule)
        for reason, left_out in reasons.items():
            plan.skipped.append(f"pipeline {', '.join(left_out)} at world size {world_size}: "
                                f"{reason}")
        for simulate_ms in [args.simulate_ms, None] if fits else []:
            for case, schedule in [("one-process", "afab")] + [("pipeline", s) for s in fits]:
                stages = world_size if case == "pipeline" else 1
                plan.cases[world_size].append({
                    "case": case, "model": "wine-mlp", "schedule": schedule, "knob": None,
                    "world_size": stages, "stages": stages,
                    "chunks": 2 if schedule in TWO_CHUNKS else 1, "backend": plan.backend,
                    "device": plan.device_type,
                    "threads_per_rank": max(1, plan.cores // world_size),
                    "layers": args.pipeline_layers, "microbatches": args.microbatches,
                    "global_batch": args.batch_size, "simulate_ms": simulate_ms,
                    "steps": args.pipeline_steps if simulate_ms is None else args.bubble_steps,
                    # A simulated step sleeps for long: one warm-up step sets the pipeline up.
                    "warmup": args.warmup if simulate_ms is None else 1})


def tensor_parallel_sizes(layout, top):
    """The world sizes 1..top at which lesson 09's layout runs: tp at 2+ ranks that divide the
    hidden units (fc2 is row-wise: its 3 outputs are whole on every rank, its 64 inputs split),
    2d at even world sizes of 4 or more (dp = world size / 2, at least 2)."""
    if layout == "tp":
        return [n for n in range(2, top + 1) if HIDDEN % n == 0]
    return [n for n in range(2 * TP_2D, top + 1) if n % TP_2D == 0 and HIDDEN % TP_2D == 0]


def pipeline_problem(schedule, stages, args):
    """Why lesson 10's schedule cannot run on this many stages, or None (its check_pipeline's
    rules): the linear layers split evenly over the stages (interleaved, zbv, dualpipev: 2 per
    rank); as torch requires, 1f1b a micro-batch per stage, interleaved and zb1p micro-batches
    that split into max(1, m // stages) equal rounds, dualpipev 2 micro-batches per rank."""
    pieces = stages * (2 if schedule in TWO_CHUNKS else 1)
    linears = args.pipeline_layers + 1
    if linears % pieces:
        return f"{linears} linear layers (--pipeline-layers {args.pipeline_layers}) do not " \
               f"split evenly into {pieces} stages"
    if schedule == "1f1b" and args.microbatches < stages:
        return f"1f1b needs at least one micro-batch per stage (--microbatches " \
               f"{args.microbatches})"
    rounds = max(1, args.microbatches // stages)
    if schedule in ("interleaved", "zb1p") and args.microbatches % rounds:
        return f"{schedule} runs the micro-batches in {rounds} equal rounds (--microbatches " \
               f"{args.microbatches} does not split into them)"
    if schedule == "dualpipev" and args.microbatches < 2 * stages:
        return f"dualpipev needs at least one micro-batch per stage, {2 * stages} " \
               f"(--microbatches {args.microbatches})"
    return None
