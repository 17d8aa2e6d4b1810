"""The built-in MAT 5 reader (``fmtl_flower.data.mat_v5``): a device without scipy reads the
``.mat`` datasets exactly as ``scipy.io.loadmat`` does.

* every MATLAB 5 file of scipy's own test data that holds no struct, object or function
  (written by MATLAB 6.1 to 7.4, little- and big-endian, compressed or not: doubles, ints,
  complex, sparse, logical, char, cells) reads to the same variables, values, shapes and
  types (byte order aside: this reader returns native order);
* structs, objects, functions, MAT 7.3 (HDF5) and corrupt files are refused with
  ``MatFormatError`` (a ``ValueError``) saying what;
* ``load_mat_tasks`` in a process where scipy cannot be imported (a device's base install)
  returns the same tasks as with scipy, for files ``scipy.io.savemat`` writes and for the
  shared reference files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.data import load_mat_tasks
from fmtl_flower.data.mat_v5 import MatFormatError, read_mat_v5

from .helpers import MatWriter, toy_tasks

scipy_io = pytest.importorskip("scipy.io")
scipy_sparse = pytest.importorskip("scipy.sparse")
SCIPY_DATA = Path(scipy_io.__file__).parent / "matlab" / "tests" / "data"
UNSUPPORTED = ("struct", "object", "func", "sqr", "parabola", "simplecell",
               "duplicate_fieldnames")


def _v5_files() -> list[Path]:
    """MAT 5 headers (and the HDF5 ones of 7.3, which scipy refuses and the test skips)."""
    return sorted(p for p in SCIPY_DATA.glob("*.mat") if p.read_bytes()[126:128] in (b"IM", b"MI"))


def _assert_same(mine: object, ref: object, where: str) -> None:
    if scipy_sparse.issparse(ref):
        ref = ref.toarray()
    assert isinstance(mine, np.ndarray) and isinstance(ref, np.ndarray), where
    assert mine.shape == ref.shape, (where, mine.shape, ref.shape)
    if ref.dtype == object:
        assert mine.dtype == object, where
        for i, (a, b) in enumerate(zip(mine.ravel(), ref.ravel(), strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
        return
    assert mine.dtype == ref.dtype.newbyteorder("="), (where, mine.dtype, ref.dtype)
    np.testing.assert_array_equal(mine, ref, err_msg=where)


def test_reads_what_scipy_reads() -> None:
    files = _v5_files()
    checked = []
    for path in files:
        if any(word in path.name for word in UNSUPPORTED):
            continue
        try:
            ref = scipy_io.loadmat(path)
        except Exception:  # files scipy itself refuses (malformed on purpose)
            continue
        mine = read_mat_v5(path)
        names = sorted(k for k in ref if not k.startswith("__"))
        assert sorted(mine) == names, path.name
        for name in names:
            _assert_same(mine[name], ref[name], f"{path.name}:{name}")
        checked.append(path.name)
    # big-endian (SOL2), compressed (7.x), sparse, complex, cells, chars all among them
    for word in ("SOL2", "7.4", "sparse", "complex", "cell", "string", "logical"):
        assert any(word in name for name in checked), (word, checked)
    assert len(checked) >= 50, len(checked)


@pytest.mark.parametrize("name, reason", [
    ("teststruct_7.4_GLNX86.mat", "class 2"),
    ("testobject_7.1_GLNX86.mat", "class 3"),
    ("testhdf5_7.4_GLNX86.mat", "7.3"),
    ("corrupted_zlib_data.mat", "corrupt compressed"),
])
def test_refuses_what_it_cannot_read(name: str, reason: str) -> None:
    with pytest.raises(MatFormatError, match=reason):
        read_mat_v5(SCIPY_DATA / name)


def test_refuses_non_mat_and_truncated_files(tmp_path: Path, write_mat: MatWriter) -> None:
    short = tmp_path / "short.mat"
    short.write_bytes(b"MATLAB 5.0 MAT-file" + b" " * 20)
    with pytest.raises(MatFormatError, match="too short"):
        read_mat_v5(short)
    Xs, ys = toy_tasks()
    whole = write_mat("whole.mat", X=Xs, Y=ys).read_bytes()
    cut = tmp_path / "cut.mat"
    cut.write_bytes(whole[:len(whole) - 40])
    with pytest.raises(MatFormatError):
        read_mat_v5(cut)


_LOAD_WITHOUT_SCIPY = """
import json, sys
sys.modules["scipy"] = None  # a base install: `import scipy...` raises ImportError
from fmtl_flower.data import load_mat_tasks
Xs, ys = load_mat_tasks(sys.argv[1])
print(json.dumps({"X": [X.tolist() for X in Xs], "y": [y.tolist() for y in ys],
                  "dtypes": sorted({str(a.dtype) for a in Xs + ys}),
                  "scipy": any(m.startswith("scipy.") for m in sys.modules)}))
"""


def _load_without_scipy(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_SCIPY, str(path)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("compress", [False, True])
def test_load_mat_tasks_without_scipy_equals_with(tmp_path: Path, compress: bool) -> None:
    Xs, ys = toy_tasks()
    cells = np.empty((1, len(Xs)), dtype=object)
    labels = np.empty((1, len(ys)), dtype=object)
    for t, (X, y) in enumerate(zip(Xs, ys, strict=True)):
        cells[0, t] = X
        labels[0, t] = np.asarray(y, dtype=np.int16).reshape(-1, 1)  # as the reference files
    path = tmp_path / "tasks.mat"
    scipy_io.savemat(path, {"X": cells, "Y": labels}, do_compression=compress)
    ref_X, ref_y = load_mat_tasks(path)
    got = _load_without_scipy(path)
    assert got["scipy"] is False and got["dtypes"] == ["float64"]
    assert got["X"] == [X.tolist() for X in ref_X]
    assert got["y"] == [y.tolist() for y in ref_y]


def test_reference_files_without_scipy(shared_data_dir: Path) -> None:
    for name in ("small.mat", "EAT_VOC.mat"):
        ref_X, ref_y = load_mat_tasks(shared_data_dir / name)
        got = _load_without_scipy(shared_data_dir / name)
        assert got["scipy"] is False
        assert got["X"] == [X.tolist() for X in ref_X], name
        assert got["y"] == [y.tolist() for y in ref_y], name
