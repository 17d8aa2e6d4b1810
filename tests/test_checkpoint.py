"""State files: atomic writes, no pickle, corrupt and foreign files refused with a reason."""

from __future__ import annotations

import io

import numpy as np
import pytest

from fmtl_flower.checkpoint import (
    CheckpointError,
    read_checkpoint,
    read_state_file,
    state_file_path,
    write_checkpoint,
    write_state_file,
)


def test_round_trip_keeps_arrays_bit_for_bit_and_meta(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"W": rng.normal(size=(3, 4)), "rounds": np.arange(5), "mask": np.array([True])}
    path = write_state_file(tmp_path / "s.npz", arrays, {"round": 7, "name": "x"})
    got, meta = read_state_file(path)
    for key, value in arrays.items():
        np.testing.assert_array_equal(got[key], value)
        assert got[key].dtype == value.dtype
    assert meta["round"] == 7 and meta["name"] == "x" and meta["format"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]  # no temporary file left


def test_object_arrays_and_nan_meta_are_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype object"):
        write_state_file(tmp_path / "s.npz", {"x": np.array([{}], dtype=object)}, {})
    with pytest.raises(ValueError):
        write_state_file(tmp_path / "s.npz", {"x": np.zeros(1)}, {"v": float("nan")})
    assert not list(tmp_path.iterdir())


def test_pickled_npz_is_not_loaded(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, __meta__=np.array([{"format": 1}], dtype=object))
    with pytest.raises(CheckpointError, match="unreadable"):
        read_state_file(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no-meta", "other-format"])
def test_damaged_files_are_refused_with_a_reason(tmp_path, damage):
    path = write_state_file(tmp_path / "s.npz", {"x": np.zeros(3)}, {})
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "garbage":
        path.write_bytes(b"not a zip file")
    elif damage == "no-meta":
        np.savez(path, x=np.zeros(3))
    else:
        buffer = io.BytesIO()
        np.savez(buffer, x=np.zeros(3),
                 __meta__=np.frombuffer(b'{"format": 99}', dtype=np.uint8))
        path.write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError):
        read_state_file(path)


def test_newest_checkpoint_wins_and_only_keep_are_kept(tmp_path):
    for r in (1, 2, 3, 4):
        write_checkpoint(tmp_path, r, {"w": np.full(2, float(r))}, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000003.npz",
                                                          "round-000004.npz"]
    checkpoint = read_checkpoint(tmp_path)
    assert checkpoint.server_round == 4 and checkpoint.arrays["w"][0] == 4.0


def test_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    write_checkpoint(tmp_path, 1, {"w": np.zeros(2)}, {})
    newest = write_checkpoint(tmp_path, 2, {"w": np.ones(2)}, {})
    newest.write_bytes(newest.read_bytes()[:30])
    assert read_checkpoint(tmp_path).server_round == 1
    assert "skipping unreadable checkpoint" in caplog.text


def test_no_checkpoint_and_renamed_checkpoint(tmp_path):
    assert read_checkpoint(tmp_path / "missing") is None
    assert read_checkpoint(tmp_path) is None
    path = write_checkpoint(tmp_path, 3, {"w": np.zeros(1)}, {})
    path.rename(tmp_path / "round-000009.npz")
    with pytest.raises(CheckpointError, match="does not match its name"):
        read_checkpoint(tmp_path)


def test_state_file_path_validates(tmp_path):
    assert state_file_path(tmp_path, "mocha", 3).name == "mocha-task-3.npz"
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError):
            state_file_path(tmp_path, "mocha", bad)
    with pytest.raises(ValueError):
        state_file_path(tmp_path, "../x", 1)


def test_a_checkpoint_written_under_a_former_class_name_still_matches(tmp_path):
    """Checkpoints of runs before the PEP 8 class names store ``"strategy": "Mocha"``: they
    resume under ``MOCHA``; another strategy's checkpoint is still refused."""
    from fmtl_flower.checkpoint import check_fingerprint

    write_checkpoint(tmp_path, 3, {"W": np.zeros(2)},
                     {"fingerprint": {"strategy": "Mocha", "num_tasks": 4}})
    checkpoint = read_checkpoint(tmp_path)
    check_fingerprint(checkpoint, {"strategy": "MOCHA", "num_tasks": 4})
    with pytest.raises(CheckpointError, match="strategy"):
        check_fingerprint(checkpoint, {"strategy": "MbSGD", "num_tasks": 4})


def test_the_former_class_names_are_deprecated_aliases():
    import fmtl_flower
    from fmtl_flower._renamed import RENAMED

    for old, new in RENAMED.items():
        if new not in fmtl_flower.__all__:
            continue
        with pytest.warns(DeprecationWarning, match=f"now fmtl_flower.{new}"):
            assert getattr(fmtl_flower, old) is getattr(fmtl_flower, new)
    assert "Mocha" not in fmtl_flower.__all__ and "MOCHA" in fmtl_flower.__all__
    with pytest.raises(AttributeError):
        fmtl_flower.NoSuchThing  # noqa: B018
