"""The chart behind a ``plan --slo`` answer: each SLO's metric against the number of replicas, one line per GPU
type, the limit drawn across."""

from __future__ import annotations

from pathlib import Path

from backends.sim.capacity import FleetPlan
from loadtest.extras import require


def plan_chart(plans: list[FleetPlan], slos: dict[str, float], path: Path) -> None:
    """Write the chart of ``plans`` against ``slos`` (summary key -> ms limit) to ``path`` (PNG)."""
    require("matplotlib", "plan --plot").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(slos), figsize=(5 * len(slos), 4), squeeze=False)
    for ax, (key, limit) in zip(axes[0], slos.items()):
        for p in plans:
            points = [(point.replicas, point.summary[key]) for point in p.curve]
            ax.plot(*zip(*points), marker="o", label=f"{p.gpu} (TP {p.tensor_parallel_size})")
        ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_xlabel("replicas")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(key)
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
