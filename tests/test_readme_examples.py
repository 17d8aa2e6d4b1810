"""Every Python snippet of the README and of the documentation site (``docs/``) is an
example app's file, included verbatim (``--8<-- "examples/..."``; those run as they are:
``tests/examples``), or is run here as written, in simulation conditions (node configs with
``partition-id`` only, no ``task-id``); the one ``py`` block (FedEM on a PyTorch model, in
``docs/guides/fedem.md``) runs in ``tests/strategies/test_fedem_torch.py`` where torch is
installed. The run-config reference the site generates covers every key."""

import importlib.util
import logging
import re
from pathlib import Path

import pytest

from fmtl_flower import MOCHA
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.settings import ConfigError

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {path: path.read_text() for path in sorted((ROOT / "docs").rglob("*.md"))}
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$', flags=re.M)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def inline_blocks() -> list[str]:
    """The Python blocks written out in the README and the pages (not included files)."""
    blocks = python_blocks(README)
    for text in PAGES.values():
        blocks += [b for b in python_blocks(text) if not INCLUDE.fullmatch(b.strip())]
    return blocks


def test_every_snippet_is_an_example_file_or_run_here():
    includes = [m[1] for text in PAGES.values() for m in INCLUDE.finditer(text)]
    files = [path for path in includes if path.startswith("examples/")]
    assert len(files) >= 7
    for path in includes:
        assert (ROOT / path.partition(":")[0]).is_file(), path
    runs = inline_blocks()
    assert len(runs) == 3, runs  # run by the tests below
    assert "partition_loader(" in runs[0] + runs[1] and "server_app.main()" in runs[0]


def readme_app() -> dict:
    (snippet,) = python_blocks(README)
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102
    return namespace


def test_readme_app_runs_as_written(capsys, caplog):
    app = readme_app()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_inprocess(app["server_app"], app["client_app"], 4,
                      run_config={"mocha.lambda": 0.01, "mocha.omega-every": 5,
                                  "my-app.batch-size": 32})
    out = capsys.readouterr().out
    match = re.search(r"per-task test error (\S+), duality gap (\S+)", out)
    assert match, out
    assert float(match[1]) < 0.3 and float(match[2]) >= 0
    assert "failed" not in caplog.text


def test_readme_apps_run_config_is_strict():
    app = readme_app()
    with pytest.raises(ConfigError, match=r"did you mean mocha.lambda\?"):
        run_inprocess(app["server_app"], app["client_app"], 4,
                      run_config={"mocha.lamda": 0.01})


def test_flwr_datasets_snippet_runs_in_simulation_conditions(caplog):
    pytest.importorskip("flwr_datasets")
    (snippet,) = [b for b in inline_blocks() if "partition_loader(" in b]
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102
    grid = InProcessGrid(namespace["app"], 10)
    assert all(set(c.node_config) == {"partition-id", "num-partitions"}
               for c in grid.contexts.values())
    strategy = MOCHA(num_tasks=10, lam=0.01, discovery_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, num_rounds=5, timeout=30.0)
    final = strategy.results()["final"]
    assert final["complete"] and final["gap"] >= 0 and final["test_error"] < 0.3
    assert "failed" not in caplog.text


def test_generated_run_config_reference_covers_every_key():
    spec = importlib.util.spec_from_file_location("reference", ROOT / "docs/hooks/reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    rows = [row for rows in reference.key_rows().values() for row in rows]
    assert sorted(row[0].strip("`") for row in rows) == sorted(RunConfig.keys())
    assert [row[0] for row in rows if not row[3]] == []  # every key has a meaning
    page = reference.on_page_markdown(PAGES[ROOT / "docs/reference/run-config.md"], None)
    assert "`mocha.lambda`" in page and reference.KEYS_MARKER not in page


def test_main_job_command_is_the_documented_one():
    assert 'pip install -e ".[simulation]" && fmtl run mocha' in README
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert 'pip install -e ".[all]" && python -m pytest -q' in README  # one command: all
    assert 'pip install -q -e ".[all]"' in ci
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
    assert "mkdocs build --strict\n" in ci and len(README.splitlines()) <= 200  # not -q


def test_async_mocha_guide_snippet_runs_as_written(capsys):
    """docs/guides/async-mocha.md's Flower-free simulation: it prints the virtual time to a
    1e-3 relative gap (reached) and the last record, whose gap is >= 0."""
    (snippet,) = python_blocks(PAGES[ROOT / "docs" / "guides" / "async-mocha.md"])
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102
    run = namespace["run"]
    assert run.time_to_gap(1e-3) is not None
    assert run.records[-1]["gap"] >= 0
    assert capsys.readouterr().out.strip()
