"""Pictures of a parallel layout: which rank holds which pipeline stage, data shard and TP slice."""

from __future__ import annotations

import matplotlib.pyplot as plt

from canntrain_core.runtime.distributed import ParallelDims, rank_coordinates


def rank_grid(dims: ParallelDims, devices_per_node: int = 8, title: str = ""):
    """One box per rank: rows are pipeline stages x data-parallel groups, columns tensor-parallel slices.

    The colour is the pipeline stage; the label gives rank, dp index and tp slice; dashed lines
    mark node boundaries (ranks are numbered node by node).
    """
    coords = rank_coordinates(dims)
    rows = dims.pp * dims.dp * dims.cp
    cols = dims.tp
    fig, ax = plt.subplots(figsize=(min(1.1 * cols + 1.5, 12), 0.55 * rows + 1.2))
    cmap = plt.get_cmap("tab10")
    for c in coords:
        dp = c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
        row = (c["pp"] * dims.dp + dp) * dims.cp + c["cp"]
        ax.add_patch(plt.Rectangle((c["tp"], rows - 1 - row), 0.95, 0.9, color=cmap(c["pp"] % 10), alpha=0.75))
        ax.text(
            c["tp"] + 0.47,
            rows - 1 - row + 0.45,
            f"r{c['rank']}\ndp{dp} tp{c['tp']}",
            ha="center",
            va="center",
            fontsize=7,
        )
        if c["rank"] % devices_per_node == 0 and c["rank"]:
            ax.axhline(rows - row, color="k", ls="--", lw=0.8)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_xticks([i + 0.47 for i in range(cols)], [f"tp {i}" for i in range(cols)])
    ax.set_yticks(
        [rows - 1 - r + 0.45 for r in range(rows)],
        [f"pp {r // (dims.dp * dims.cp)} / dp {(r // dims.cp) % dims.dp}" for r in range(rows)],
    )
    ax.set_title(title or " x ".join(f"{n} {s}" for n, s in dims.named_sizes()) or "1 process")
    fig.tight_layout()
    return fig
