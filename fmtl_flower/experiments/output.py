"""Writing a reproduction's JSON, CSV and plot."""

from __future__ import annotations

import csv
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("fmtl_flower")


def runs_per_dataset(datasets: Sequence[str], seeds: int, run_one: Callable[[str, int], Any],
                     skipped: dict[str, str]) -> Iterator[tuple[str, int, Any, float]]:
    """``(dataset, seed, run_one(dataset, seed), seconds)`` for every dataset and seed
    ``0 .. seeds - 1``.

    A dataset whose data are missing (``FileNotFoundError``) is skipped with a warning and
    its reason recorded in ``skipped``; FileNotFoundError at the end if no run succeeded.
    """
    done = 0
    for dataset in datasets:
        for seed in range(seeds):
            started = time.perf_counter()
            try:
                result = run_one(dataset, seed)
            except FileNotFoundError as err:
                skipped[dataset] = str(err).splitlines()[0]
                logger.warning("%s: skipped (%s)", dataset, skipped[dataset])
                break
            done += 1
            yield dataset, seed, result, time.perf_counter() - started
    if not done:
        raise FileNotFoundError(f"no dataset could be loaded: {skipped}")


def write_outputs(out_dir: Path, name: str, payload: dict[str, Any],
                  plot: Callable[[Any, dict[str, Any]], None] | None = None) -> dict[str, Path]:
    """Write ``NAME.json`` (the payload), ``NAME.csv`` (its rows) and ``NAME.png`` (``plot``).

    The PNG is skipped, with a log line, when matplotlib is not installed (``pip install
    fmtl-flower[plot]``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "csv": out_dir / f"{name}.csv"}
    paths["json"].write_text(json.dumps(payload, indent=1))
    rows = payload["rows"]
    with open(paths["csv"], "w", newline="") as f:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed: %s.png not written", name)
            return paths
        fig = plt.figure(figsize=(7, 4.5))
        plot(fig, payload)
        fig.tight_layout()
        paths["png"] = out_dir / f"{name}.png"
        fig.savefig(paths["png"], dpi=120)
        plt.close(fig)
    return paths
