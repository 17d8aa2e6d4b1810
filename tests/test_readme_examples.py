"""The README's Python snippets run as written (with the data loader pointed at temp files)."""

import re
from pathlib import Path

import numpy as np

from fmtl_flower.engine import run_inprocess

README = (Path(__file__).parents[1] / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_server_and_client_snippets_run_together(tmp_path, capsys):
    server_src, client_src = python_blocks()[:2]
    rng = np.random.default_rng(0)
    for task in range(10):
        X = rng.normal(size=(30, 4))
        np.savez(tmp_path / f"task{task}.npz", X=X, y=np.where(X[:, 0] > 0, 1.0, -1.0))
    client_ns: dict = {}
    exec(client_src.replace("/data/", f"{tmp_path}/"), client_ns)  # noqa: S102
    server_ns: dict = {}
    exec(server_src.replace("num_rounds=100", "num_rounds=5"), server_ns)  # noqa: S102
    run_inprocess(server_ns["app"], client_ns["app"], 10,
                  node_configs=[{"task-id": t} for t in range(10)])
    gap, test_error = capsys.readouterr().out.split()
    assert float(gap) >= 0 and test_error == "None"  # the loader gives no test split


def test_fedem_snippets_run_together(tmp_path, capsys):
    _, mocha_client_src, server_src, client_src = python_blocks()
    rng = np.random.default_rng(1)
    for task in range(10):
        X = rng.normal(size=(40, 4))
        np.savez(tmp_path / f"task{task}.npz", X=X, y=np.where(X[:, 0] > 0, 1.0, -1.0))
    client_ns: dict = {}
    exec(mocha_client_src.replace("/data/", f"{tmp_path}/"), client_ns)  # noqa: S102 (load_data)
    exec(client_src, client_ns)  # noqa: S102
    server_src = (server_src.replace("num_rounds=100", "num_rounds=3")
                  .replace("num_tasks=100", "num_tasks=10")
                  .replace("range(80, 100)", "range(8, 10)"))
    server_ns: dict = {}
    exec(server_src, server_ns)  # noqa: S102
    run_inprocess(server_ns["app"], client_ns["app"], 10,
                  node_configs=[{"task-id": t} for t in range(10)])
    accuracy, unseen = capsys.readouterr().out.split()
    assert accuracy == "None" and unseen == "None"  # the loader gives no test split


def test_main_job_command_is_the_documented_one():
    assert 'pip install -e ".[simulation]" && fmtl run mocha' in README
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert 'pip install -e ".[all]" && python -m pytest -q' in README  # one command: all
    assert 'pip install -q -e ".[all]"' in ci
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
