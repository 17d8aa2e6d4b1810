"""``fmtl run --ray-address``: refused without ``--engine ray`` and when malformed (no Ray).

The run on a real Ray cluster is the slow test ``tests/apps/test_ray_cluster.py``.
"""

import pytest

from fmtl_flower.cli import main
from fmtl_flower.engine import validate_ray_address


def test_ray_address_needs_the_ray_engine(capsys):
    assert main(["run", "mocha", "--rounds", "1", "--ray-address", "127.0.0.1:6379"]) == 2
    err = capsys.readouterr().err
    assert "--ray-address needs --engine ray" in err
    assert main(["run", "mocha", "--engine", "inprocess", "--ray-address", "auto"]) == 2
    assert "--ray-address needs --engine ray" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["127.0.0.1", "head:", ":6379", "head:0", "head:65536",
                                     "head:port", "ray://head:10001", "head:6379 ", "a b:1",
                                     ""])
def test_malformed_ray_address_is_refused(capsys, address):
    # refused before any dataset is loaded or Ray is started
    assert main(["run", "mocha", "--engine", "ray", "--ray-address", address]) == 2
    err = capsys.readouterr().err
    assert f"invalid Ray address {address!r}" in err
    assert "HOST:PORT" in err
    with pytest.raises(ValueError, match="invalid Ray address"):
        validate_ray_address(address)


def test_ray_address_is_refused_for_centralised_baselines(capsys):
    assert main(["run", "local", "--engine", "ray", "--ray-address", "127.0.0.1:6379"]) == 2
    assert "--engine applies to federated strategies" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["auto", "127.0.0.1:6379", "head-node.lan:6379",
                                     "10.0.0.7:1", "[::1]:6379", "[fe80::1]:65535"])
def test_well_formed_ray_addresses(address):
    assert validate_ray_address(address) == address


def test_malformed_ray_address_env_is_refused_before_ray_starts(monkeypatch):
    # run_ray honours RAY_ADDRESS as ray.init does; a bad one is named in the error
    from fmtl_flower.engine import run_ray

    monkeypatch.setenv("RAY_ADDRESS", "head")
    with pytest.raises(ValueError, match="RAY_ADDRESS: invalid Ray address 'head'"):
        run_ray(None, None, 2)  # type: ignore[arg-type]  # refused before the apps are used
