"""``vitrify bench ... --plot``: one PNG of a result's ratios (needs matplotlib).

One horizontal bar per ratio (measured against the baseline of the same run), the goal of each
ratio that has one as a black tick, bars green where the goal is met, red where it is missed and
grey where there is no goal. A ratio's goal is a lower bound unless the result's
``goal_direction`` says ``<=`` for it. Ratios that are not finite numbers are left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import resultlib
from .resultlib import finite


MET, MISSED, NO_GOAL = "#2e7d32", "#c62828", "#9e9e9e"


def goal_met(res: dict[str, Any], key: str) -> bool | None:
    """Whether ratio `key` meets its goal (None: no goal); :func:`resultlib.goal_met`."""
    return resultlib.goal_met(res.get("ratios", {}), res.get("goals", {}),
                              res.get("goal_direction", {}), key)


def plot_ratios(res: dict[str, Any], path: str | Path) -> Path:
    """Write the ratios of result `res` as a PNG at `path` and return the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ratios = {k: v for k, v in sorted(res.get("ratios", {}).items()) if finite(v)}
    path = Path(path)
    title = (f"vitrify bench {res.get('name', '?')}: ratios vs the same run's baselines\n"
             f"{res.get('date', '')}  {str(res.get('git_sha', ''))[:12]}")
    height = 1.2 + 0.28 * max(1, len(ratios))
    fig, ax = plt.subplots(figsize=(10, height))
    try:
        if not ratios:
            ax.text(0.5, 0.5, "no ratios in this result", ha="center", va="center")
            ax.set_axis_off()
        else:
            names = list(ratios)
            values = [ratios[k] for k in names]
            colors = []
            for k in names:
                met = goal_met(res, k)
                colors.append(NO_GOAL if met is None else (MET if met else MISSED))
            ys = range(len(names))
            ax.barh(ys, values, color=colors)
            goals = [(y, res["goals"][k]) for y, k in zip(ys, names)
                     if finite(res.get("goals", {}).get(k))]
            if goals:
                ax.scatter([g for _, g in goals], [y for y, _ in goals], marker="|", s=200,
                           color="black", zorder=3, label="goal")
                handles, _ = ax.get_legend_handles_labels()
                handles += [Patch(color=c, label=t) for c, t in
                            ((MET, "goal met"), (MISSED, "goal missed"), (NO_GOAL, "no goal"))]
                ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                          fontsize="small")
            positive = [v for v in values if v > 0]
            if positive and len(positive) == len(values) and max(positive) / min(positive) > 50:
                ax.set_xscale("log")
            ax.axvline(1.0, color="black", linewidth=0.6, linestyle=":")
            ax.set_yticks(list(ys))
            ax.set_yticklabels(names, fontsize="small")
            ax.invert_yaxis()
            ax.set_xlabel("value (dotted line: 1.0)")
        ax.set_title(title, fontsize="medium")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
