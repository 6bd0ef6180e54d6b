"""The Llama 3 paper's layouts of 405B (Dubey et al., "The Llama 3 Herd of Models", arXiv
2407.21783, Table 4), measured: each rank that differs built as it would build itself, in
PyTorch's fake process group under fake tensors, and one step of it run.

    python 14_planning/prove_llama3.py

Table 4's rows (GPUs, TP, CP, PP, DP, sequence length, sequences a step per DP rank): 8,192 8 1
16 64 8,192 32; 16,384 8 1 16 128 8,192 16; 16,384 8 16 16 8 131,072 16 (arXiv's v1 printed DP 4
in the last row: 16,384 / (8 x 16 x 16) = 8, as v3 prints). Each step is 16 M tokens. As the
paper runs them: FSDP that keeps each block gathered from forward to backward, bf16 compute with
float32 gradients, no recomputation, one block fewer on the first and the last of 16 stages
(126 blocks: 7, 8 x 14, 7); here one sequence a micro-batch and 1F1B (the paper's schedule is an
interleaved variant of its own). For each row: the largest rank, its margin to 80 GB, and what a
step sends across nodes. The control: FSDP as lesson 13's, each block gathered again for every
micro-batch's forward, must multiply FSDP's all-gathers by m + 1 a block.
"""

from fake_ranks import Layout
from plan import GB, crosses_nodes, measure_layout

from model import CONFIGS

LLAMA = CONFIGS["llama3-405b"]
MEMORY, PER_NODE = 80 * GB, 8
TABLE_4 = [(8192, 8, 1, 16, 64, 8192, 32), (16384, 8, 1, 16, 128, 8192, 16),
           (16384, 8, 16, 16, 8, 131072, 16)]  # GPUs, TP, CP, PP, DP, seq, sequences per DP


def layout(tp, cp, pp, dp, seq_len, per_dp, data="kept"):
    return Layout(dp, pp, tp, cp, per_dp, 1, seq_len, data)


def across_nodes(lay, row):
    """GB the rank sends in a step on each dimension whose groups span nodes."""
    return {dim: sum(b for _, b in kinds.values()) for dim, kinds in row["collectives"].items()
            if crosses_nodes(dim, lay, PER_NODE)}


def main():
    print("Llama 3 405B, Table 4's layouts (GB = 1e9 bytes); the largest rank of each, measured:")
    rows = []
    for gpus, tp, cp, pp, dp, seq_len, per_dp in TABLE_4:
        lay = layout(tp, cp, pp, dp, seq_len, per_dp)
        assert lay.world == gpus and dp * per_dp * seq_len == 2 ** 24  # 16 M tokens a step
        measured = measure_layout(LLAMA, lay)
        worst = max(measured.values(), key=lambda row: row["total"])
        rows.append((lay, measured))
        kinds = ", ".join(f"{k} {worst[k] / GB:.1f}" for k in ("weights", "gradients",
                          "optimizer", "gathered", "activations"))
        sent = ", ".join(f"{dim} {b / GB:.1f}" for dim, b in across_nodes(lay, worst).items())
        print(f"  {gpus:6,} GPUs, tp {tp} cp {cp:2} pp {pp} dp {dp:3}, {seq_len:7,} tokens: stage "
              f"{worst['stage']} holds {worst['total'] / GB:6.1f} GB ({kinds}): "
              f"{'fits' if worst['total'] <= MEMORY else 'does not fit'}, "
              f"{(MEMORY - worst['total']) / GB:+.1f} GB; sent across nodes a step: {sent}")
    lay, measured = rows[1]
    kept = measured[1]["collectives"]["dp"]["all-gather"][0]
    lesson13 = measure_layout(LLAMA, layout(8, 1, 16, 128, 8192, 16, "fsdp"), stages=[1])[1]
    again = lesson13["collectives"]["dp"]["all-gather"][0]
    blocks, m = measured[1]["blocks"], lay.microbatches
    print(f"control, FSDP as lesson 13's on stage 1 of the second row (a middle stage: no weights "
          f"but its blocks'): {again} all-gathers a step, not {kept}: each of its {blocks} blocks "
          f"gathered m + 1 = {m + 1} times, not once: "
          f"caught: {(kept, again) == (blocks, blocks * (m + 1))}")


if __name__ == "__main__":
    main()
