"""What a run prints and draws: the tables of samples/s, memory, bandwidth and the pipeline's
bubble, the sentences that read them, and scaling.png."""

from bench.flags import SHARDED, TENSOR_PARALLEL, TP_2D
from bench.rows import case_name, find_row, format_bytes


def number(value, spec):
    return "N/A" if value is None else format(value, spec)


def spread(row):
    return f"{row['samples_per_s_min']:.1f}-{row['samples_per_s_max']:.1f}"


def print_tables(rows, bandwidth_rows):
    """The training table, what it says for each model, the memory and bandwidth tables."""
    print_training(rows)
    print()
    for model in dict.fromkeys(row["model"] for row in rows):
        print_model_summary(rows, model)
    print_memory(rows)
    if bandwidth_rows:
        print_bandwidth(bandwidth_rows)


def print_training(rows):
    print("\nTraining throughput: samples/s is the median of the repeats, min-max their spread. "
          "Speed-up and efficiency (= speed-up / world size) against 1 rank of DDP, or for "
          "ddp-per-worker, ceiling, zero1 and fsdp against 1 rank of the same case; vs ceiling = "
          "against as many independent processes with the same threads and batch; vs default = "
          "against DDP with default settings at the same world size; DDP cost = 1 - DDP/plain "
          "at world size 1; tp and 2d count each TP group's batch once (batch = batch per rank "
          "x dp)")
    header = (f"{'model':9} {'case':30} {'ws':>3} {'thr':>4} {'batch':>6} {'samples/s':>10} "
              f"{'min-max':>15} {'speed-up':>9} {'effic.':>7} {'vs ceil.':>8} "
              f"{'vs default':>10} {'DDP cost':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        name = case_name(row)
        cost = "" if row["ddp_cost_pct"] is None else f"{row['ddp_cost_pct']:.1f}%"
        print(f"{row['model']:9} {name:30} {row['world_size']:3d} {row['threads_per_rank']:4d} "
              f"{row['global_batch']:6d} {row['samples_per_s']:10.1f} {spread(row):>15} "
              f"{number(row['speedup'], '9.2f'):>9} {number(row['efficiency'], '7.2f'):>7} "
              f"{number(row['efficiency_vs_ceiling'], '8.2f'):>8} "
              f"{number(row['vs_default'], '10.2f'):>10} {cost:>8}")


def print_model_summary(rows, model):
    """The table read in sentences for one model: DDP's own cost, its efficiency per worker and
    against the ceiling, the best knob, and the fastest case."""
    for case, alone, what in (("ddp", "plain", "every core"),
                              ("ddp-per-worker", "ceiling", "per worker")):
        plain, ddp = find_row(rows, model, alone, 1), find_row(rows, model, case, 1)
        if plain and ddp:
            print(f"{model}: {what}, DDP at world size 1 runs at {ddp['samples_per_s']:.1f} "
                  f"samples/s ({spread(ddp)}), the plain model at "
                  f"{plain['samples_per_s']:.1f} ({spread(plain)}): DDP's own cost is "
                  f"{ddp['ddp_cost_pct']:.1f}% (nobody to talk to; what is left is the "
                  f"wrapper)")
    per_worker = sorted((r for r in rows if r["model"] == model
                         and r["case"] == "ddp-per-worker"), key=lambda r: r["world_size"])
    if len(per_worker) > 1:
        print_per_worker(rows, model, per_worker[0], per_worker[-1])
    # The ceiling trains N separate models: not a way to train this one.
    best = max((r for r in rows if r["model"] == model and r["knob"] is None
                and r["case"] != "ceiling"), key=lambda r: r["samples_per_s"])
    print(f"{model}: fastest is {best['case']} with world size {best['world_size']}, "
          f"{best['samples_per_s']:.1f} samples/s")


def print_per_worker(rows, model, one, top):
    """Per worker: N ranks against 1, against the ceiling, the best knob, and all cores."""
    print(f"{model}: per worker ({one['threads_per_rank']} thread(s) per rank), "
          f"{top['world_size']} ranks run {top['samples_per_s']:.1f} samples/s "
          f"({spread(top)}) against {one['samples_per_s']:.1f} ({spread(one)}) for 1 "
          f"rank: DDP's efficiency {top['efficiency']:.0%} = "
          f"{top['samples_per_s']:.1f} / ({top['world_size']} x "
          f"{one['samples_per_s']:.1f})")
    ceiling = find_row(rows, model, "ceiling", top["world_size"])
    if ceiling:
        print(f"{model}: ceiling, {ceiling['world_size']} independent processes at "
              f"once (no communication) run {ceiling['samples_per_s']:.1f} samples/s "
              f"({spread(ceiling)}), {ceiling['efficiency']:.0%} of "
              f"{ceiling['world_size']} x one process alone: DDP's efficiency against "
              f"this ceiling is {top['efficiency_vs_ceiling']:.0%}")
    tuned = [r for r in rows if r["model"] == model and r["world_size"] == top["world_size"]
             and r["case"] == "ddp" and r["knob"] is not None
             and r["efficiency_vs_ceiling"] is not None]
    if tuned:
        best = max(tuned, key=lambda r: r["efficiency_vs_ceiling"])
        print(f"{model}: the knob closest to the ceiling is {best['knob']}="
              f"{best['knob_value']}, at {best['efficiency_vs_ceiling']:.0%} of it")
    all_cores = find_row(rows, model, "single-process-all-cores", 1)
    shared = find_row(rows, model, "ddp", top["world_size"])
    if all_cores and shared:
        print(f"{model}: all cores, one process with {all_cores['threads_per_rank']} "
              f"threads and batch {all_cores['global_batch']} runs "
              f"{all_cores['samples_per_s']:.1f} samples/s; {shared['world_size']} DDP "
              f"ranks sharing the same cores run {shared['samples_per_s']:.1f}")


def print_bandwidth(bandwidth_rows):
    print("\nAll-reduce bandwidth (time/op: the median of the repeats, min-max their "
          "spread; algbw = bytes / time; busbw = algbw * 2(n-1)/n, as nccl-tests defines "
          "it; N/A with 1 rank)")
    header = (f"{'backend':8} {'device':6} {'ws':>3} {'size':>10} {'time/op':>11} "
              f"{'min-max, ms':>17} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    print(header)
    print("-" * len(header))
    for row in bandwidth_rows:
        print(f"{row['backend']:8} {row['device']:6} {row['world_size']:3d} "
              f"{format_bytes(row['size_bytes']):>10} "
              f"{row['seconds_per_op'] * 1e3:8.3f} ms "
              f"{row['seconds_per_op_min'] * 1e3:8.3f}-{row['seconds_per_op_max'] * 1e3:.3f}"
              f" {row['algbw_GBps']:11.3f} "
              f"{number(row['busbw_GBps'], '11.3f'):>11}")


def print_pipeline(rows):
    """Lesson 10's schedules: the bubble against its formula, samples/s with and without the
    simulated compute, each against one process running the same micro-batches."""
    if not rows:
        return
    first = rows[0]
    print(f"\nPipeline (lesson 10): the wine MLP with --layers {first['layers']} "
          f"({first['layers'] + 1} linear layers), batch {first['global_batch']} in "
          f"{first['microbatches']} micro-batches; median of the repeats (min-max). bubble: "
          "idle share of the p ranks' time per step, with each layer sleeping "
          f"{number(first['simulate_ms'], 'g')} ms forward and "
          "twice that backward (B and W each once), against lesson 10's prediction at "
          "F = B = W ((p - 1) / (v*m + p - 1); zb1p (p - 1) / (3m + p - 1); zbv 0; dualpipev "
          "none); speed-up: against one process running the same micro-batches in turn, same "
          "threads, measured in the same launch; ideal: p x (1 - formula)")
    header = (f"{'schedule':12} {'p x v':>5} {'formula':>7} {'bubble':>6} {'min-max':>11} "
              f"{'sim. samples/s':>14} {'min-max':>13} {'speed-up':>8} {'ideal':>5} "
              f"{'samples/s':>9} {'min-max':>15} {'speed-up':>8}")
    print(header)
    print("-" * len(header))
    pairs = {}
    for row in rows:
        key = (row["processes"], row["case"], row["schedule"])
        pairs.setdefault(key, {})["sim" if row["simulate_ms"] is not None else "plain"] = row
    for (_, case, schedule), pair in pairs.items():
        sim, plain = pair.get("sim"), pair.get("plain")
        any_row = sim or plain
        name = schedule if case == "pipeline" else "one process"
        columns = f"{name:12} {any_row['stages']:>3}x{any_row['chunks']} " \
                  f"{number(any_row['bubble_formula'], '7.3f'):>7} "
        if sim:
            columns += (f"{sim['bubble']:6.3f} {sim['bubble_min']:.3f}-{sim['bubble_max']:.3f} "
                        f"{sim['samples_per_s']:14.1f} {spread(sim):>13} "
                        f"{number(sim['speedup'], '8.2f'):>8} "
                        f"{number(sim['ideal_speedup'], '5.2f'):>5} ")
        else:
            columns += f"{'':6} {'':11} {'':14} {'':13} {'':8} {'':5} "
        if plain:
            columns += (f"{plain['samples_per_s']:9.1f} {spread(plain):>15} "
                        f"{number(plain['speedup'], '8.2f'):>8}")
        print(columns)


def held_bytes(row):
    """Parameters, gradients and optimizer state: what a rank holds between steps."""
    return row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]


def print_memory(rows):
    """What each rank holds under DDP, ZeRO-1, FSDP, TP and 2-D, and what sharding costs in
    samples/s."""
    split = (*SHARDED, *TENSOR_PARALLEL)
    cases, models = ("ddp", *split), list(dict.fromkeys(r["model"] for r in rows))
    mine = sorted((r for r in rows if r["case"] in cases and r["knob"] is None),
                  key=lambda r: (models.index(r["model"]), r["world_size"], cases.index(r["case"])))
    if not any(r["case"] in split for r in mine):
        return
    print("\nMemory per rank, MiB (the most loaded rank, after the last step; optimizer: SGD's "
          "momentum, one tensor per parameter; peak: torch.cuda.max_memory_allocated, N/A on "
          "the CPU)")
    header = (f"{'model':9} {'case':6} {'ws':>3} {'parameters':>11} {'gradients':>10} "
              f"{'optimizer':>10} {'total':>9} {'vs ddp':>7} {'peak':>9} {'samples/s':>10}")
    print(header)
    print("-" * len(header))
    mib = 2**20
    for row in mine:
        held = held_bytes(row)
        ddp_held = held_bytes(find_row(rows, row["model"], "ddp", row["world_size"]))
        peak = "N/A" if row["peak_bytes"] is None else f"{row['peak_bytes'] / mib:.1f}"
        print(f"{row['model']:9} {row['case']:6} {row['world_size']:3d} "
              f"{row['parameter_bytes'] / mib:11.3f} {row['gradient_bytes'] / mib:10.3f} "
              f"{row['optimizer_bytes'] / mib:10.3f} {held / mib:9.3f} {held / ddp_held:7.0%} "
              f"{peak:>9} {row['samples_per_s']:10.1f}")
    top = max(r["world_size"] for r in mine)
    for model in dict.fromkeys(r["model"] for r in mine):
        ddp = find_row(rows, model, "ddp", top)
        for case in split:
            row = find_row(rows, model, case, top)
            if row and ddp:
                share = held_bytes(row) / held_bytes(ddp)
                print(f"{model}: {case} on {top} ranks holds {share:.0%} of DDP's "
                      f"parameters, gradients and optimizer state per rank, at "
                      f"{row['vs_default']:.2f} x DDP's samples/s")


def plot(rows, bandwidth_rows, path):
    """samples/s against world size per model, each point the median with its spread as an
    error bar (min to max); the all-reduce bandwidth."""
    # Imported here: only the launching process plots, and the ranks skip matplotlib's import.
    import matplotlib

    matplotlib.use("Agg")  # write a file; no window, no display needed
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in rows))
    panels = len(models) + (1 if bandwidth_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        plot_model(ax, [r for r in rows if r["model"] == model and r["knob"] is None], model)
    if bandwidth_rows:
        plot_bandwidth(axes[0][-1], bandwidth_rows)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve(ax, points, fmt, **style):
    """samples/s against world size: the medians, with min-max error bars."""
    points = sorted(points, key=lambda r: r["world_size"])
    ax.errorbar([r["world_size"] for r in points], [r["samples_per_s"] for r in points],
                yerr=[[r["samples_per_s"] - r["samples_per_s_min"] for r in points],
                      [r["samples_per_s_max"] - r["samples_per_s"] for r in points]],
                fmt=fmt, capsize=3, **style)


def plot_model(ax, mine, model):
    """One model's panel: DDP and its ideal, per worker with its ceiling, the strategies and
    layouts, DataParallel, and the single processes as horizontal bands."""
    ddp = sorted((r for r in mine if r["case"] == "ddp"), key=lambda r: r["world_size"])
    sizes = [r["world_size"] for r in ddp]
    curve(ax, ddp, "o-",
          label="DDP" if ddp[0]["device"] == "cuda" else "DDP, ranks sharing the cores")
    ax.plot(sizes, [ddp[0]["samples_per_s"] * w for w in sizes], "k--", alpha=0.5,
            label="ideal linear scaling")
    per_worker = sorted((r for r in mine if r["case"] == "ddp-per-worker"),
                        key=lambda r: r["world_size"])
    if per_worker:
        threads = per_worker[0]["threads_per_rank"]
        curve(ax, per_worker, "^-", color="tab:purple",
              label=f"DDP, {threads} thread(s) per rank (per worker)")
        ax.plot(sizes, [per_worker[0]["samples_per_s"] * w for w in sizes], ":",
                color="tab:purple", alpha=0.5, label="its ideal linear scaling")
        curve(ax, [r for r in mine if r["case"] == "ceiling"], "x--", color="tab:gray",
              label="ceiling: as many independent processes, no communication")
    for case, marker, style in (
            ("zero1", "v-", {"label": "ZeRO-1"}), ("fsdp", "D-", {"label": "FSDP"}),
            ("tp", "P-", {"label": "TP, one group of all ranks", "color": "tab:brown"}),
            ("2d", "*-", {"label": f"2-D, dp x tp with tp = {TP_2D}", "color": "tab:olive"}),
            ("dataparallel", "s-", {"label": "DataParallel"})):
        points = [r for r in mine if r["case"] == case]
        if points:
            curve(ax, points, marker, **style)
    for row in (r for r in mine if r["case"] in ("plain", "single-process-all-cores")):
        color = "tab:green" if row["case"] == "plain" else "tab:red"
        ax.axhline(row["samples_per_s"], linestyle=":", color=color,
                   label=f"{row['case']} ({row['threads_per_rank']} threads, "
                         f"batch {row['global_batch']})")
        ax.axhspan(row["samples_per_s_min"], row["samples_per_s_max"], color=color, alpha=0.15)
    ax.set_title(f"{model} ({ddp[0]['device']}, {ddp[0]['backend']}; median, min-max)")
    ax.set_xlabel("world size (ranks; GPUs for DataParallel)")
    ax.set_ylabel("samples / s")
    ax.set_xticks(sizes)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def plot_bandwidth(ax, bandwidth_rows):
    """Bus bandwidth (algorithm bandwidth at 1 rank) against message size, per backend."""
    series = dict.fromkeys((r["backend"], r["device"], r["world_size"]) for r in bandwidth_rows)
    for backend, device, world_size in series:
        mine = [r for r in bandwidth_rows if (r["backend"], r["device"], r["world_size"])
                == (backend, device, world_size)]
        key = "busbw_GBps" if world_size > 1 else "algbw_GBps"
        # Bandwidth is bytes / time: the fastest repeat gives the top of the bar.
        ax.errorbar([r["size_bytes"] for r in mine], [r[key] for r in mine],
                    yerr=[[r[key] * (1 - r["seconds_per_op"] / r["seconds_per_op_max"])
                           for r in mine],
                          [r[key] * (r["seconds_per_op"] / r["seconds_per_op_min"] - 1)
                           for r in mine]],
                    fmt="o-", capsize=3,
                    label=f"{backend} {device} ws={world_size} ({key.split('_')[0]})")
    ax.set_xscale("log", base=2)
    ax.set_title("all-reduce bandwidth (median, min-max)")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)
