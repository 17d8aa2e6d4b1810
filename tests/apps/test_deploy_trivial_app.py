"""The trivial Flower App that ``benchmarks/loopback_rounds.py`` runs as MOCHA's baseline on
the same SuperNodes: in process, every node answers every round with a vector of the size it
was sent, and the server writes per-round times and a complete run to ``results-file``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flwr.app import Context, RecordDict

from fmtl_flower.engine import InProcessGrid

APP_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "trivial_flower_app"


def test_trivial_app_rounds_in_process(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(APP_DIR))
    for name in [m for m in sys.modules if m.startswith("trivial_flower_app")]:
        monkeypatch.delitem(sys.modules, name)
    from trivial_flower_app.client_app import app as client_app
    from trivial_flower_app.server_app import app as server_app

    results = tmp_path / "trivial.json"
    run_config = {"num-nodes": 3, "num-server-rounds": 2, "dim": 7, "round-timeout": 30.0,
                  "results-file": str(results)}
    grid = InProcessGrid(client_app, 3, run_config=run_config)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                             run_config=run_config))
    out = json.loads(results.read_text())
    assert out["final"]["complete"] is True
    assert [r["round"] for r in out["rounds"]] == [1, 2]
    assert all(r["num_replies"] == 3 and r["wall_time_s"] >= 0 for r in out["rounds"])
