"""The benchmark's flags: what each measures, its defaults for the device at hand, and one line
that names the fix when a value is wrong."""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

COURSE = Path(__file__).resolve().parent.parent.parent
MODELS = ("wine-mlp", "resnet18")
KNOBS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "fp16_hook", "bf16_hook",
         "no_sync")
# Lesson 07's strategies, measured next to DDP at every world size.
SHARDED = ("zero1", "fsdp")
# Lesson 09's layouts of the wine MLP, made by its own build_mesh and split_model
# (09_tensor_parallel/train.py and its tensor_parallel.py): tp, every rank of the world size in
# one TP group; 2d, dp x tp with TP groups of TP_2D ranks and FSDP across them. ResNet-18 has
# none: the plan splits Linear layers, not convolutions.
LESSON09 = COURSE / "09_tensor_parallel"
TENSOR_PARALLEL = ("tp", "2d")
TP_2D = 2
HIDDEN = 64  # the wine MLP's hidden units: fc1's output columns, dealt out over the TP ranks
# Lesson 08's hand-written gradient synchronisations (and DDP through the same function),
# measured with --grad-sync; its make_grad_sync(model, mode, bucket_mb) returns the model to call
# and finish(), to call between loss.backward() and optimizer.step().
LESSON08 = COURSE / "08_ddp_from_scratch"
GRAD_SYNC = ("after-backward", "flat", "overlap", "buckets", "ddp")
# Lesson 10's schedules, measured with --pipeline: its own Trainer.train_step on its deeper wine
# MLP (WineMLP(hidden, layers)), split by its split_model, one stage per rank (interleaved, zbv
# and dualpipev: two).
LESSON10 = COURSE / "10_pipeline_parallel"
PIPELINE = ("afab", "gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
TWO_CHUNKS = ("interleaved", "zbv", "dualpipev")  # the schedules that put two stages on a rank


def fail(message):
    """Stop with one line that says what is wrong and how to fix it (no traceback)."""
    sys.exit(f"error: {message}")


def cpu_cores():
    """The cores this process may run on (a container or taskset may allow fewer than exist)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def parse_args(argv=None):
    """The flags, the device's defaults filled in for those not given, each checked: a value
    that cannot work stops the run with one line (fail)."""
    args = build_parser().parse_args(argv)
    bf16_supported = choose_device(args)
    for name, value in default_settings(args.device_type, args.quick, bf16_supported).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    read_lists(args)
    check_numbers(args)
    return args


def build_parser():
    parser = argparse.ArgumentParser(
        description="Measure DDP's samples/s for world sizes 1..N next to a plain model, one "
                    "process with every core and ranks of a few threads each (CPU) or "
                    "DataParallel (GPUs), DDP's knobs and the all-reduce bandwidth. Every "
                    "timing excludes the warm-up steps.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_run_flags(parser.add_argument_group("the run"))
    add_training_flags(parser.add_argument_group("the training cases"))
    add_bandwidth_flags(parser.add_argument_group("the all-reduce bandwidth"))
    add_pipeline_flags(parser.add_argument_group("lesson 10's pipeline (--pipeline)"))
    return parser


def add_run_flags(group):
    group.add_argument("--quick", action="store_true",
                       help="fewer repeats and steps, and on the CPU smaller inputs: about 2 "
                            "minutes on a 2-core laptop; sets the defaults below marked "
                            "(quick: ...)")
    group.add_argument("--out-dir", default="runs/benchmarks",
                       help="folder for results.json/.csv, allreduce.json/.csv, run.json and "
                            "scaling.png")
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="auto: CUDA (NCCL, DataParallel) when GPUs are visible, else CPU "
                            "(gloo)")
    group.add_argument("--max-world-size", type=int, default=None,
                       help="measure world sizes 1..N (default: one per GPU, or one per CPU "
                            "core)")
    group.add_argument("--repeats", type=int, default=None,
                       help="measurements of every case, taken in rounds (one of each case "
                            "per round); each figure is their median, printed with min-max "
                            "(default 5; quick: 3)")
    group.add_argument("--timeout", type=int, default=300,
                       help="seconds a case's build or one of its repeats may take before the "
                            "ranks are stopped")


def add_training_flags(group):
    group.add_argument("--models", default=",".join(MODELS),
                       help=f"comma-separated, from {','.join(MODELS)}")
    group.add_argument("--batch-size", type=int, default=None,
                       help="samples per step per rank (CPU: 16, quick: 8; GPU: 256)")
    group.add_argument("--image-size", type=int, default=None,
                       help="side of ResNet-18's random images (CPU: 112, quick: 64; GPU: 224)")
    group.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                       help="ResNet-18's forward pass: fp32, or bf16 autocast (CPU: fp32; GPU: "
                            "bf16 where the GPU runs it natively, compute capability 8.0+)")
    group.add_argument("--channels-last", default=None, action=argparse.BooleanOptionalAction,
                       help="ResNet-18's weights and images in channels_last (N,H,W,C) memory "
                            "format (CPU: off; GPU: on)")
    group.add_argument("--steps", type=int, default=None,
                       help="timed steps per repeat for ResNet-18 and the knobs (CPU: 6, "
                            "quick: 4; GPU: 20, quick: 10)")
    group.add_argument("--mlp-steps", type=int, default=None,
                       help="timed steps per repeat for the wine MLP, whose steps take well "
                            "under a millisecond (default 200; quick: 100)")
    group.add_argument("--warmup", type=int, default=None,
                       help="untimed steps once per case, before its first repeat; at least 1, "
                            "which allocates memory and lets DDP set up its buckets (CPU: 3, "
                            "quick: 2; GPU: 10, quick: 5)")
    group.add_argument("--threads-per-worker", type=int, default=None,
                       help="CPU threads of each rank in the per-worker case, where 1 rank and "
                            "N ranks all get this many (default: cores // max world size)")
    group.add_argument("--knobs", default=",".join(KNOBS),
                       help="DDP settings to measure at the largest world size, comma-separated, "
                            "or none")
    group.add_argument("--accumulate", type=int, default=4,
                       help="micro-batches per optimizer step for the no_sync knob")
    group.add_argument("--sharded", default=",".join(SHARDED),
                       help="lesson 07's strategies to measure next to DDP at every world size, "
                            "comma-separated, or none")
    group.add_argument("--tensor-parallel", default=",".join(TENSOR_PARALLEL),
                       help="lesson 09's layouts of the wine MLP to measure next to DDP, "
                            "comma-separated, or none: tp, every rank in one TP group (world "
                            f"sizes 2+ that divide its {HIDDEN} hidden units); 2d, dp x tp "
                            f"with tp = {TP_2D} (even world sizes of 4 or more)")
    group.add_argument("--grad-sync", default="none",
                       help="lesson 08's gradient synchronisations to measure on ResNet-18 at "
                            "the largest world size (on the CPU with the per-worker threads), "
                            f"comma-separated from {','.join(GRAD_SYNC)}, or none; it imports "
                            "08_ddp_from_scratch/train.py")


def add_bandwidth_flags(group):
    group.add_argument("--allreduce-sizes", default=None,
                       help="all-reduce message sizes (default 4K,64K,1M,16M,64M; quick: "
                            "4K,1M,16M)")
    group.add_argument("--allreduce-iters", type=int, default=None,
                       help="timed all-reduces per size per repeat (default 10; quick: 5)")


def add_pipeline_flags(group):
    group.add_argument("--pipeline", default="none",
                       help="lesson 10's schedules to measure at every world size of 2 or "
                            "more where they fit, one stage per rank, comma-separated from "
                            f"{','.join(PIPELINE)}, or none; it imports "
                            "10_pipeline_parallel/train.py")
    group.add_argument("--pipeline-layers", type=int, default=7,
                       help="hidden layers of lesson 10's wine MLP for --pipeline (its "
                            "--layers): --pipeline-layers + 1 linear layers split over the "
                            "stages")
    group.add_argument("--microbatches", type=int, default=8,
                       help="micro-batches each --pipeline batch (--batch-size) is cut into")
    group.add_argument("--simulate-ms", type=float, default=10.0,
                       help="for the bubble of --pipeline: each layer sleeps this long forward "
                            "and twice that backward (lesson 10's measure_bubble.py "
                            "--simulate-ms); a sleep "
                            "takes no CPU, so more ranks than cores keep a clean timeline")
    group.add_argument("--bubble-steps", type=int, default=None,
                       help="timed steps per repeat of a --pipeline case with --simulate-ms; a "
                            "repeat's bubble is the median of its steps' (default 2; quick: 1)")
    group.add_argument("--pipeline-steps", type=int, default=None,
                       help="timed steps per repeat of a --pipeline case without simulated "
                            "compute (default 20; quick: 10)")


def choose_device(args):
    """args.device_type, cuda or cpu, and args.precision_note; returns whether GPU 0 runs bf16
    natively (and bf16 was not turned down)."""
    gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda needs a CUDA GPU and none is visible; use --device cpu")
    if args.device == "cuda" and not dist.is_nccl_available():
        fail("--device cuda needs NCCL, which this torch build lacks; use --device cpu")
    args.device_type = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    on_gpus = args.device_type == "cuda"
    bf16_supported = on_gpus and args.precision != "fp32" and cuda_supports_bf16()
    if on_gpus and args.precision == "bf16" and not bf16_supported:
        major, minor = torch.cuda.get_device_capability(0)
        fail(f"--precision bf16 needs a GPU that runs bf16 natively (compute capability 8.0+, "
             f"e.g. A100, H100); GPU 0 has {major}.{minor}: use --precision fp32")
    args.precision_note = None
    if on_gpus and args.precision is None and not bf16_supported:
        args.precision_note = ("precision: fp32, since GPU 0 has no native bf16 (compute "
                               "capability below 8.0)")
    return bf16_supported


def read_lists(args):
    """The comma-separated flags as lists, each item checked against its choices."""
    args.models = parse_list(args.models, MODELS, "--models")
    args.knobs = parse_list(args.knobs, KNOBS, "--knobs")
    args.sharded = parse_list(args.sharded, SHARDED, "--sharded")
    args.tensor_parallel = parse_list(args.tensor_parallel, TENSOR_PARALLEL, "--tensor-parallel")
    args.grad_sync = parse_list(args.grad_sync, GRAD_SYNC, "--grad-sync")
    args.pipeline = parse_list(args.pipeline, PIPELINE, "--pipeline")
    if args.pipeline and not (LESSON10 / "train.py").exists():
        fail(f"--pipeline needs lesson 10's {LESSON10 / 'train.py'}, which is missing; run "
             "from a full copy of the course, or leave --pipeline out")
    if args.grad_sync and not (LESSON08 / "train.py").exists():
        fail(f"--grad-sync needs lesson 08's {LESSON08 / 'train.py'}, which is missing; run "
             "from a full copy of the course, or leave --grad-sync out")
    args.allreduce_sizes = [parse_size(s.strip()) for s in args.allreduce_sizes.split(",")
                            if s.strip()]


def check_numbers(args):
    """The world size (default: one rank per GPU or core) and every count, each at least 1."""
    gpus = torch.cuda.device_count()
    if args.max_world_size is None:
        args.max_world_size = gpus if args.device_type == "cuda" else cpu_cores()
    if args.device_type == "cuda" and args.max_world_size > gpus:
        fail(f"--max-world-size {args.max_world_size} needs as many GPUs (one per rank), but "
             f"{gpus} visible; use --max-world-size {gpus} or --device cpu")
    if args.threads_per_worker is None:
        args.threads_per_worker = max(1, cpu_cores() // max(args.max_world_size, 1))
    for name in ("max_world_size", "batch_size", "image_size", "steps", "mlp_steps",
                 "accumulate", "allreduce_iters", "timeout", "threads_per_worker", "repeats",
                 "warmup", "pipeline_layers", "microbatches", "bubble_steps", "pipeline_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if not 0 <= args.simulate_ms < float("inf"):  # nan fails this too
        fail(f"--simulate-ms must be at least 0 (got {args.simulate_ms:g})")
    if args.pipeline and args.batch_size % args.microbatches:
        fail(f"--microbatches {args.microbatches} does not divide --batch-size "
             f"{args.batch_size}: every micro-batch of a pipeline must have the same shape; "
             "choose a --batch-size that is a multiple of --microbatches")
    if "resnet18" in args.models and args.image_size < 32:
        fail(f"--image-size {args.image_size} is too small for ResNet-18's five halvings; "
             "use 32 or more")


def parse_size(text):
    """'4K', '1M', '64M' or a number of bytes -> bytes."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale < 4:
        fail(f"--allreduce-sizes: {text!r} is not a size; use bytes or K/M/G, e.g. 4K,1M,64M")
    return int(digits) * scale // 4 * 4  # whole float32 elements


def parse_list(text, allowed, flag):
    items = [item.strip() for item in text.split(",") if item.strip()]
    if items == ["none"]:
        return []
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        fail(f"{flag}: unknown {', '.join(unknown) or 'empty list'}; choose from "
             f"{','.join(allowed)}" + (" or none" if flag != "--models" else ""))
    return items


def default_settings(device_type, quick, bf16_supported=False):
    """The defaults of the flags that depend on the device, as {name: value}.

    Steps are per repeat: every figure is the median of `repeats` of them. CPU: small inputs,
    so that the full run takes minutes on a 2-core laptop. CUDA: ResNet-18 as
    it is trained on a GPU, 224x224 images, batch 256 per GPU, bf16 autocast and channels_last,
    so that a step keeps the GPU busy. A step of 16 small images is over before Python has
    launched the next kernels: it would time the launches (and make DDP's few hundred
    microseconds of Python per step look like a quarter of the work), not the GPU."""
    if device_type == "cuda":
        # Native bf16 needs compute capability 8.0 (Ampere) or newer; older GPUs stay in fp32.
        precision = "bf16" if bf16_supported else "fp32"
        table = {"batch_size": (256, 256), "image_size": (224, 224), "steps": (20, 10),
                 "warmup": (10, 5), "precision": (precision, precision),
                 "channels_last": (True, True)}
    else:
        table = {"batch_size": (16, 8), "image_size": (112, 64), "steps": (6, 4),
                 "warmup": (3, 2), "precision": ("fp32", "fp32"),
                 "channels_last": (False, False)}
    table.update({"repeats": (5, 3), "mlp_steps": (200, 100), "allreduce_iters": (10, 5),
                  "pipeline_steps": (20, 10), "bubble_steps": (2, 1),
                  "allreduce_sizes": ("4K,64K,1M,16M,64M", "4K,1M,16M")})
    return {name: quick_value if quick else full for name, (full, quick_value) in table.items()}


def cuda_supports_bf16():
    """Whether GPU 0 runs bf16 natively: compute capability 8.0 (Ampere) or newer, the test
    torch.cuda.is_bf16_supported(including_emulation=False) makes; ROCm GPUs all do."""
    return torch.version.hip is not None or torch.cuda.get_device_capability(0)[0] >= 8
