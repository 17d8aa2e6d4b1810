"""Every Python snippet of the README is one of the example apps' files, verbatim (those run
as they are: ``tests/examples``), or is run here as written, in simulation conditions (node
configs with ``partition-id`` only, no ``task-id``)."""

import logging
import re
from pathlib import Path

import pytest

from fmtl_flower import Mocha
from fmtl_flower.engine import InProcessGrid

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
HEADER = re.compile(r"# (examples/\S+\.py)\n")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def run_blocks() -> list[str]:
    """The blocks that are not example files: each must be run by a test below."""
    return [b for b in python_blocks() if not HEADER.match(b)]


def test_every_snippet_is_an_example_file_or_run_here():
    files = [HEADER.match(b) for b in python_blocks() if HEADER.match(b)]
    assert len(files) >= 6
    for match in files:
        block = match.string
        assert block[match.end():] == (ROOT / match[1]).read_text(), match[1]
    runs = run_blocks()
    assert len(runs) == 1 and "partition_loader(" in runs[0]  # run by the test below


def test_flwr_datasets_snippet_runs_in_simulation_conditions(caplog):
    pytest.importorskip("flwr_datasets")
    (snippet,) = [b for b in run_blocks() if "partition_loader(" in b]
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102
    grid = InProcessGrid(namespace["app"], 10)
    assert all(set(c.node_config) == {"partition-id", "num-partitions"}
               for c in grid.contexts.values())
    strategy = Mocha(num_tasks=10, lam=0.01, discovery_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, num_rounds=5, timeout=30.0)
    final = strategy.results()["final"]
    assert final["complete"] and final["gap"] >= 0 and final["test_error"] < 0.3
    assert "failed" not in caplog.text


def test_main_job_command_is_the_documented_one():
    assert 'pip install -e ".[simulation]" && fmtl run mocha' in README
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert 'pip install -e ".[all]" && python -m pytest -q' in README  # one command: all
    assert 'pip install -q -e ".[all]"' in ci
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
