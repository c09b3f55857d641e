"""Writing a benchmark's results: JSON (everything), CSV (the summary table) and a PNG plot."""

from __future__ import annotations

import csv
import json
import os
from typing import Any


def new_figure(ncols: int = 1, figsize: tuple[float, float] = (7, 4), nrows: int = 1, sharex: bool = False):
    """A matplotlib figure and axes (one per row and column), drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if nrows > 1:
        figsize = (figsize[0], 2.6 * nrows)
    return plt.subplots(nrows=nrows, ncols=ncols, figsize=figsize, sharex=sharex)


def write(out_dir: str, stem: str, rows: list[dict], payload: dict[str, Any], fig) -> list[str]:
    """<stem>.json ({"summary": rows, **payload}), <stem>.csv (rows) and <stem>.png (fig, titled with
    ``payload["machine"]`` unless it has a title); returns the paths."""
    import matplotlib.pyplot as plt

    info = payload.get("machine")
    if info and not fig.get_suptitle():
        fig.suptitle(f"{info['cpu_model']} ({info['cpu_cores']} cores), {info['date_utc']}", fontsize=8)

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "csv", "png")]
    with open(paths[0], "w") as f:
        json.dump({"summary": rows, **payload}, f, indent=1)
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["note"])
        writer.writeheader()
        writer.writerows(rows)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths
