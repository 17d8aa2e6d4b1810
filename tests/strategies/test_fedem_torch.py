"""FedEM with ``model="torch"``: real in-process federations with the torch ClientApp.

Agreement with the numpy backend (logistic, float64), the public API (initial_components,
start(initial_arrays=...), component_records), a small CNN on a relabelled image mixture
(FedEM vs FedAvg, unseen clients fitting pi by EM), and that torch stays unimported unless
the torch backend is used.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.fedem_torch import make_fedem_torch_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.core.models import make_model
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.fedem import FedEM

from .test_fedem_strategy import mixture_problem

torch = pytest.importorskip("torch")


def federate(app, num_tasks: int, rounds: int, initial_arrays: ArrayRecord | None = None,
             **kwargs: Any) -> FedEM:
    kwargs.setdefault("lr", 0.5)
    kwargs.setdefault("batch_size", 32)
    strategy = FedEM(num_tasks, discovery_timeout=5.0, **kwargs)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=initial_arrays, num_rounds=rounds,
                       timeout=60.0)

    run_inprocess(server, app, num_tasks)
    return strategy


def linear_record(theta: np.ndarray) -> ArrayRecord:
    """numpy logistic params [w, b] as the state_dict of a float64 nn.Linear(d, 1)."""
    net = torch.nn.Linear(theta.size - 1, 1).double()
    with torch.no_grad():
        net.weight.copy_(torch.from_numpy(theta[:-1]).reshape(1, -1))
        net.bias.copy_(torch.from_numpy(theta[-1:]))
    return ArrayRecord(net.state_dict())


@pytest.fixture(scope="module")
def problem():
    return mixture_problem()


def test_torch_and_numpy_federations_agree_on_a_logistic_model(problem):
    d = problem[0][0].shape[1]

    def load(context):
        return problem[default_task_id(context)]

    numpy_run = federate(make_fedem_client_app(load), len(problem), 4, num_components=2)
    init = [make_model("logistic", d).init_params(np.random.default_rng([0, m, 37]))
            for m in range(2)]
    torch_run = federate(
        make_fedem_torch_client_app(lambda: torch.nn.Linear(d, 1).double(), load),
        len(problem), 4, num_components=2, model="torch",
        initial_components=[linear_record(t) for t in init])
    assert not np.allclose(numpy_run.components, np.stack(init))
    np.testing.assert_allclose(torch_run.components, numpy_run.components, rtol=0, atol=1e-6)
    for a, b in zip(numpy_run.records, torch_run.records, strict=True):
        assert a["accuracy_mean"] == b["accuracy_mean"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-9)
    records = torch_run.component_records()
    net = torch.nn.Linear(d, 1).double()
    net.load_state_dict(records[1].to_torch_state_dict())
    np.testing.assert_array_equal(net.weight.detach().numpy().ravel(),
                                  torch_run.components[1][:-1])


def test_one_component_from_start_initial_arrays_and_clear_errors(problem):
    d = problem[0][0].shape[1]

    def load(context):
        return problem[default_task_id(context)]

    app = make_fedem_torch_client_app(lambda: torch.nn.Linear(d, 1).double(), load)
    start = ArrayRecord(torch.nn.Linear(d, 1).double().state_dict())
    fedavg = federate(app, len(problem), 3, initial_arrays=start, method="fedavg",
                      model="torch")
    assert fedavg.results()["final"]["accuracy_mean"] > 0.6
    assert fedavg.components.shape == (1, d + 1)
    with pytest.raises(ValueError, match="initial_components"):
        federate(app, len(problem), 1, num_components=3, model="torch")
    with pytest.raises(ValueError, match="has 1 ArrayRecords, expected 3"):
        FedEM(4, num_components=3, model="torch", initial_components=[start])
    other = ArrayRecord(torch.nn.Linear(d + 1, 1).double().state_dict())
    with pytest.raises(ValueError, match=r"initial_components\[1\] has another layout"):
        FedEM(4, num_components=2, model="torch", initial_components=[start, other])
    with pytest.raises(ValueError, match="for model='torch'"):
        FedEM(4, model="logistic", initial_components=[start])
    # a device whose module has another layout refuses the components (every reply fails)
    wrong = make_fedem_torch_client_app(lambda: torch.nn.Linear(d, 1), load)  # float32
    refused = federate(wrong, len(problem), 1, initial_arrays=start, method="fedavg",
                       model="torch")
    assert refused.records[0]["num_replies"] == 0
    np.testing.assert_array_equal(refused.components[0][:-1],
                                  start["weight"].numpy().ravel())


def test_checkpoint_state_restores_the_layout(problem):
    d = problem[0][0].shape[1]
    init = [ArrayRecord(torch.nn.Linear(d, 1).state_dict()) for _ in range(2)]
    a = FedEM(3, num_components=2, model="torch", initial_components=init)
    a.directory.dim = d
    arrays, meta = a.checkpoint_state()
    b = FedEM(3, num_components=2, model="torch")
    b.restore_state(arrays, meta)
    assert b.layout == a.layout and np.array_equal(b.components, a.components)
    assert b.component_records()[0]["weight"].numpy().dtype == np.float32
    assert a.fingerprint()["layout"] == b.fingerprint()["layout"]


def small_cnn(classes: int, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, classes))


def test_small_cnn_fedem_beats_fedavg_on_a_relabelled_mixture():
    """M = 3 label permutations of the same generated images; pi ~ Dirichlet(0.4) per
    client. FedAvg cannot fit the conflicting labels; FedEM can, and held-out clients fit
    their pi by EM (em-iterations > 0) and gain as much."""
    from fmtl_flower.data.fedem_images import relabelled_mixture

    tasks = relabelled_mixture(num_clients=10, samples=100, num_classes=6, size=8, seed=1)
    unseen = [0, 5]

    def load(context):
        t = default_task_id(context)
        return tasks.X[t], tasks.y[t], tasks.X_test[t], tasks.y_test[t]

    em_iterations: dict[int, int] = {}
    app = make_fedem_torch_client_app(lambda: small_cnn(6), load)

    def spy(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        if msg.metadata.message_type == "evaluate" and reply.has_content():
            metrics = reply.content["metrics"]
            em_iterations[int(metrics["task-id"])] = int(metrics["em-iterations"])
        return reply

    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for method, M in (("fedavg", 1), ("fedem", 3)):
        initial = [ArrayRecord(small_cnn(6, seed=100 + m).state_dict()) for m in range(M)]
        strategy = federate(spy, tasks.num_tasks, 15, method=method, num_components=M,
                            model="torch", initial_components=initial, num_classes=6,
                            lr=0.1, unseen_tasks=unseen, eval_every=100)
        results[method] = strategy.results()["final"]
    torch.set_num_threads(threads)
    fedem, fedavg = results["fedem"], results["fedavg"]
    assert fedem["accuracy_mean"] > fedavg["accuracy_mean"] + 0.1, results
    assert fedem["unseen_accuracy_mean"] > fedavg["unseen_accuracy_mean"] + 0.1, results
    assert all(em_iterations[t] > 1 for t in unseen)  # pi fitted by EM on the device
    assert all(em_iterations[t] == 0 for t in range(tasks.num_tasks) if t not in unseen)


def test_docs_torch_snippet_runs(tmp_path, capsys):
    import re
    from pathlib import Path

    from fmtl_flower.data.fedem_images import relabelled_mixture

    guide = (Path(__file__).parents[2] / "docs" / "guides" / "fedem.md").read_text()
    (snippet,) = re.findall(r"```py\n(.*?)```", guide, flags=re.S)
    tasks = relabelled_mixture(num_clients=10, samples=30, size=12, seed=0)
    for t in range(10):
        np.savez(tmp_path / f"task{t}.npz", X=tasks.X[t], y=tasks.y[t], X_test=tasks.X_test[t],
                 y_test=tasks.y_test[t])
    ns: dict = {}
    exec(snippet.replace("/data/", f"{tmp_path}/").replace("num_rounds=20", "num_rounds=2"),
         ns)  # noqa: S102
    run_inprocess(ns["server_app"], ns["client_app"], 10,
                  node_configs=[{"task-id": t} for t in range(10)])
    assert 0.0 <= float(capsys.readouterr().out.split()[-1]) <= 1.0


def test_importing_the_package_and_numpy_fedem_does_not_import_torch():
    code = ("import sys; import fmtl_flower, fmtl_flower.clients.fedem, "
            "fmtl_flower.clients.fedem_torch, fmtl_flower.strategies.fedem, "
            "fmtl_flower.core.fedem, fmtl_flower.apps.client_app, "
            "fmtl_flower.experiments.fedem_images; "
            "from fmtl_flower import make_fedem_torch_client_app; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("method, extra", [
    ("cfl", {}), ("pfedme", {"pfedme_lambda": 1.0, "pfedme_lr": 0.3, "unseen_tasks": [11]})])
def test_cfl_and_pfedme_run_on_torch_modules_as_on_numpy(method, extra):
    from .test_fedem_cfl_pfedme import opposite_problem

    data = opposite_problem(num_tasks=12) if method == "cfl" else mixture_problem()
    d = data[0][0].shape[1]

    def load(context):
        return data[default_task_id(context)]

    numpy_run = federate(make_fedem_client_app(load), len(data), 5, method=method, **extra)
    init = make_model("logistic", d).init_params(np.random.default_rng([0, 0, 37]))
    torch_run = federate(
        make_fedem_torch_client_app(lambda: torch.nn.Linear(d, 1).double(), load),
        len(data), 5, method=method, model="torch", initial_components=[linear_record(init)],
        **extra)
    np.testing.assert_allclose(torch_run.components, numpy_run.components, rtol=0, atol=1e-6)
    assert [c.tolist() for c in torch_run.clusters] == [c.tolist() for c in numpy_run.clusters]
    if method == "cfl":
        assert len(torch_run.clusters) == 2
    for a, b in zip(numpy_run.records, torch_run.records, strict=True):
        assert a["accuracy_mean"] == pytest.approx(b["accuracy_mean"], abs=1e-3)
