"""A device's ClientApp process, as the device-install tests run it: ``python device_child.py
BLOCKED STRATEGY STATE_DIR``.

``BLOCKED``: comma-separated top-level modules made unimportable (what a base install lacks,
e.g. ``scipy,sklearn,ray,matplotlib`` and, for a device without numba, ``numba,llvmlite``).
The process imports the ``flwr run`` ClientApp (:mod:`fmtl_flower.apps.client_app`), answers
``whoami`` and two ``train`` messages of STRATEGY's run over the synthetic dataset and prints
one JSON line: the replies' figures and which modules it loaded. STRATEGY
``import:mod1,mod2`` only imports those modules.
"""

from __future__ import annotations

import importlib.abc
import json
import sys

BLOCKED = {name for name in sys.argv[1].split(",") if name}


class _Block(importlib.abc.MetaPathFinder):
    """Stands for a package that is not installed."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _Block())


def main() -> None:
    import warnings

    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    strategy, state_dir = sys.argv[2], sys.argv[3]
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
    run_config = {"strategy": strategy, "dataset": "synthetic", "seed": 0}
    node_config = {"task-id": 3, "client-state-dir": state_dir}
    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(),
                      run_config=run_config)
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from fmtl_flower.apps.client_app import app
        from fmtl_flower.wire import from_array, to_array

        who = app(Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=7,
                          message_type=MessageType.QUERY + ".whoami"), context)
        info = who.content["info"]
        dim, n = int(info["dim"]), int(info["n-train"])
        out = []
        last_accepted = 0
        for server_round in (1, 2):
            config = {"task-id": 3, "server-round": server_round,
                      "last-accepted-round": last_accepted, "m-tt": 2.0, "sigma-prime": 1.0,
                      "budget": n, "seed": 0, "dropped": False, "eval": True,
                      "method": strategy, "theta": 0.5, "scale": 0.5}
            msg = Message(RecordDict({"arrays": ArrayRecord({"w": to_array(np.zeros(dim))}),
                                      "config": ConfigRecord(config)}),
                          dst_node_id=7, message_type=MessageType.TRAIN,
                          group_id=str(server_round))
            reply = app(msg, context)
            metrics = reply.content["metrics"]
            d_b = from_array(reply.content["arrays"]["delta-b"])
            out.append({"state-ok": int(metrics["state-ok"]), "steps": int(metrics["steps"]),
                        "delta-b-norm": float(np.linalg.norm(d_b)),
                        "finite": bool(np.all(np.isfinite(d_b)))})
            last_accepted = server_round
        caught = [str(w.message) for w in seen]
    loaded = sorted({m.split(".")[0] for m in sys.modules})
    fmtl = sorted(m for m in sys.modules if m.startswith("fmtl_flower."))
    print(json.dumps({"n": n, "dim": dim, "rounds": out, "top_level": loaded,
                      "fmtl_modules": fmtl, "warnings": caught}))


def import_only(modules: list[str]) -> None:
    """``STRATEGY`` = ``import:mod1,mod2``: import those modules only."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    print(json.dumps({"top_level": sorted({m.split(".")[0] for m in sys.modules})}))


if __name__ == "__main__":
    if sys.argv[2].startswith("import:"):
        import_only(sys.argv[2].removeprefix("import:").split(","))
    else:
        main()
