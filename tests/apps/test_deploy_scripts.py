"""The kit's key and certificate scripts keep what a deployment depends on.

``make-certs.sh``: a re-run keeps the CA (the devices' ``ca.crt`` stays valid) and re-issues
the server certificate with it; only ``--force`` makes a new CA; the CA's key lives in a
directory of its own; ``--owner`` hands the server key to the service account; openssl's
own error is shown when a step fails. ``make-node-keys.sh`` never deletes or overwrites a
key (a private key without ``.pub`` gets its public key derived, a lone ``.pub`` is left
alone) and ``--owner`` hands the private keys to the service account. All run openssl or
ssh-keygen only, in a temporary directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from .test_deploy_kit import _env, _script

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _san(cert: Path) -> str:
    return subprocess.run(["openssl", "x509", "-in", cert, "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout


def _verifies(certs: Path) -> bool:
    return subprocess.run(["openssl", "verify", "-CAfile", certs / "ca.crt",
                           certs / "server.crt"], capture_output=True).returncode == 0


@needs_openssl
def test_make_certs_rerun_keeps_the_ca_and_force_replaces_it(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    assert _script("make-certs.sh", certs, "a.local").returncode == 0
    ca = (certs / "ca.crt").read_bytes()
    first_server = (certs / "server.crt").read_bytes()
    assert not (certs / "ca.key").exists(), "the CA key lies beside server.key"
    assert (certs / "ca" / "ca.key").is_file()
    assert (certs / "ca").stat().st_mode & 0o077 == 0

    again = _script("make-certs.sh", certs, "a.local", "b.local")  # add a host name
    assert again.returncode == 0, again.stderr
    assert (certs / "ca.crt").read_bytes() == ca, "a re-run replaced the devices' CA"
    assert (certs / "server.crt").read_bytes() != first_server
    assert "DNS:b.local" in _san(certs / "server.crt") and _verifies(certs)

    forced = _script("make-certs.sh", "--force", certs)
    assert forced.returncode == 0, forced.stderr
    assert (certs / "ca.crt").read_bytes() != ca and _verifies(certs)


@needs_openssl
def test_make_certs_refuses_a_ca_whose_key_is_elsewhere(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    assert _script("make-certs.sh", certs).returncode == 0
    offline = tmp_path / "offline"
    (certs / "ca").rename(offline)  # the operator moved the CA key offline, as told
    ca = (certs / "ca.crt").read_bytes()
    out = _script("make-certs.sh", certs)
    assert out.returncode == 1 and "CA_KEY" in out.stderr and "--force" in out.stderr, out
    assert (certs / "ca.crt").read_bytes() == ca
    with_key = _script("make-certs.sh", certs, "c.local",
                       env=_env(CA_KEY=str(offline / "ca.key")))
    assert with_key.returncode == 0, with_key.stderr
    assert (certs / "ca.crt").read_bytes() == ca and _verifies(certs)


def test_make_certs_shows_openssl_errors(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "openssl").write_text('#!/bin/sh\necho "fake-openssl: cannot $1" >&2\nexit 1\n')
    (fake / "openssl").chmod(0o755)
    env = _env()
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    out = _script("make-certs.sh", tmp_path / "certs", env=env)
    assert out.returncode != 0
    assert "fake-openssl: cannot ecparam" in out.stderr, out.stderr


@needs_openssl
@needs_root
def test_make_certs_owner_gets_the_server_key_only(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    out = _script("make-certs.sh", "--owner", "nobody", certs)
    assert out.returncode == 0, out.stderr
    nobody = pwd.getpwnam("nobody").pw_uid
    assert (certs / "server.key").stat().st_uid == nobody
    assert (certs / "ca" / "ca.key").stat().st_uid == os.geteuid()
    assert (certs / "server.key").stat().st_mode & 0o077 == 0
    assert (certs.stat().st_mode & 0o005) == 0o005, "the SuperLink cannot enter DIR"
    bad = _script("make-certs.sh", "--owner", "no-such-user-xyz", tmp_path / "other")
    assert bad.returncode == 2 and "no user" in bad.stderr


def test_make_node_keys_never_deletes_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert _script("make-node-keys.sh", keys, "3").returncode == 0
    private0 = (keys / "node-0").read_bytes()
    public0 = (keys / "node-0.pub").read_text().split()[:2]
    public1 = (keys / "node-1.pub").read_bytes()
    (keys / "node-0.pub").unlink()  # lost public key: derive it again
    (keys / "node-1").unlink()  # private key on the device only: keep the .pub
    out = _script("make-node-keys.sh", keys, "3")
    assert out.returncode == 0, out.stderr
    assert (keys / "node-0").read_bytes() == private0, "the private key was replaced"
    assert (keys / "node-0.pub").read_text().split()[:2] == public0
    assert (keys / "node-1.pub").read_bytes() == public1
    assert not (keys / "node-1").exists()


@needs_root
def test_make_node_keys_owner(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    out = _script("make-node-keys.sh", "--owner", "nobody", keys, "1", "4")
    assert out.returncode == 0, out.stderr
    assert (keys / "node-4").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    assert (keys / "node-4").stat().st_mode & 0o077 == 0
