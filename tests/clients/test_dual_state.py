"""The device side of the dual commit protocol, case by case."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.checkpoint import CheckpointError
from fmtl_flower.clients.dual_state import (
    DualState,
    data_fingerprint,
    encode,
    read_dual_file,
    reconcile,
    write_dual_file,
)

N = 4
A, D, S = np.arange(1.0, 5.0), np.full(N, 0.5), np.full(N, 9.0)


def stored(committed: int, pending: int, stable: int = -1, task: int = 7):
    return np.stack([A, D, S]), {"task-id": task, "committed-round": committed,
                                 "pending-round": pending, "stable-round": stable}


@pytest.mark.parametrize(("last_accepted", "alpha", "ok"), [
    (3, A + D, True),   # the pending round was accepted: commit
    (2, A, True),       # it was not: roll back
    (1, np.zeros(N), False),  # the server is older than the device: restart
    (5, np.zeros(N), False),  # the device lost rounds: restart
])
def test_commit_rollback_restart(last_accepted, alpha, ok):
    duals, meta = stored(committed=2, pending=3)
    state = reconcile(duals, meta, task_id=7, n=N, last_accepted=last_accepted)
    np.testing.assert_array_equal(state.alpha, alpha)
    assert state.ok is ok and state.committed == (last_accepted if ok else 0)


def test_stable_copy_serves_a_server_resumed_from_its_checkpoint():
    duals, meta = stored(committed=6, pending=7, stable=4)
    state = reconcile(duals, meta, task_id=7, n=N, last_accepted=4, checkpoint_round=4)
    np.testing.assert_array_equal(state.alpha, S)
    assert state.ok and state.committed == 4 and state.stable[1] == 4


def test_stable_copy_follows_the_newest_checkpoint():
    duals, meta = stored(committed=2, pending=3, stable=1)
    state = reconcile(duals, meta, task_id=7, n=N, last_accepted=3, checkpoint_round=3)
    np.testing.assert_array_equal(state.stable[0], A + D)
    assert state.stable[1] == 3
    later = reconcile(duals, meta, task_id=7, n=N, last_accepted=3, checkpoint_round=2)
    assert later.stable[1] == 1  # committed round 3 is after checkpoint 2: keep the old copy


def test_other_task_or_shape_counts_as_nothing_stored():
    duals, meta = stored(committed=0, pending=1, task=8)
    assert not reconcile(duals, meta, task_id=7, n=N, last_accepted=1).ok
    assert reconcile(None, None, task_id=7, n=N, last_accepted=0).ok  # fresh device, round 1


def test_encode_and_file_round_trip(tmp_path):
    state = DualState(A, 3, True, (S, 2))
    duals, meta = encode(state, 7, D, 4)
    write_dual_file(tmp_path / "s.npz", duals, meta)
    back, meta_back = read_dual_file(tmp_path / "s.npz", 7, N)
    np.testing.assert_array_equal(back, np.stack([A, D, S]))
    assert meta_back == {"task-id": 7, "committed-round": 3, "pending-round": 4,
                         "stable-round": 2}
    assert read_dual_file(tmp_path / "none.npz", 7, N) is None
    with pytest.raises(CheckpointError, match="not this task"):
        read_dual_file(tmp_path / "s.npz", 8, N)


def test_state_of_other_data_counts_as_nothing_stored():
    duals, meta = stored(committed=2, pending=3)
    meta["data"] = "aaaa"
    same = reconcile(duals, meta, task_id=7, n=N, last_accepted=3, fingerprint="aaaa")
    assert same.ok and same.note == ""
    np.testing.assert_array_equal(same.alpha, A + D)
    other = reconcile(duals, meta, task_id=7, n=N, last_accepted=3, fingerprint="bbbb")
    assert not other.ok and other.note == "data changed"
    np.testing.assert_array_equal(other.alpha, np.zeros(N))
    del meta["data"]  # a state file written before fingerprints: not resumed either
    assert not reconcile(duals, meta, task_id=7, n=N, last_accepted=3, fingerprint="aaaa").ok


def test_new_run_starts_clean_and_is_no_reset():
    duals, meta = stored(committed=5, pending=6, stable=4)
    state = reconcile(duals, meta, task_id=7, n=N, last_accepted=0, checkpoint_round=0)
    assert state.ok and state.note == "new run" and state.committed == 0
    np.testing.assert_array_equal(state.alpha, np.zeros(N))
    assert reconcile(None, None, task_id=7, n=N, last_accepted=0).note == ""


def test_fingerprint_depends_on_values_and_shapes():
    X = np.arange(6.0).reshape(3, 2)
    y = np.array([1.0, -1.0, 1.0])
    f = data_fingerprint(X, y)
    assert f == data_fingerprint(X.copy(), y.copy()) and len(f) == 16
    assert f != data_fingerprint(X[::-1], y)
    assert f != data_fingerprint(X.reshape(2, 3), y)
    assert f != data_fingerprint(X, -y)
