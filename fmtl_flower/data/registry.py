"""Dataset names, data-file resolution and the single entry point :func:`load_dataset`.

Named data files (``"small"``, ``"eat-voc"``) are looked for, in order, in

1. ``$FMTL_DATA_DIR`` if the variable is set and non-empty,
2. ``../shared/data`` relative to the current working directory,
3. ``../shared/data`` relative to the repository root (the checkout that holds this
   package; ``Path(__file__).resolve().parents[3] / "shared" / "data"``),

with duplicates removed. The list is recomputed on every look-up, so changing
``FMTL_DATA_DIR`` or the working directory takes effect immediately; the module attribute
``DEFAULT_DATA_DIRS`` is computed on access as well.

The data files are never copied: they are read where they are.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fmtl_flower.data.dataset import FederatedDataset
from fmtl_flower.data.mat import load_mat_tasks
from fmtl_flower.data.split import _check_seed, _check_test_frac, split_tasks
from fmtl_flower.data.synthetic import make_synthetic_tasks

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIRS",
    "NAMED_FILES",
    "SYNTHETIC",
    "available_datasets",
    "clear_dataset_cache",
    "default_data_dirs",
    "load_dataset",
    "load_dataset_cached",
    "resolve_data_file",
]

#: Environment variable naming a directory that holds the named data files.
DATA_DIR_ENV = "FMTL_DATA_DIR"

#: Name of the generated dataset (:func:`~fmtl_flower.data.synthetic.make_synthetic_tasks`).
SYNTHETIC = "synthetic"

#: Named data files and their file names inside a data directory.
NAMED_FILES: dict[str, str] = {"small": "small.mat", "eat-voc": "EAT_VOC.mat"}

#: Arguments of :func:`load_dataset` that only apply to generated datasets.
_GENERATOR_KEYS = ("num_tasks", "dim", "samples_per_task")

_CACHE_SIZE = 8

if TYPE_CHECKING:
    DEFAULT_DATA_DIRS: tuple[Path, ...]


def default_data_dirs() -> tuple[Path, ...]:
    """Directories searched for named data files, in resolution order.

    Returns
    -------
    tuple of Path
        ``$FMTL_DATA_DIR`` (if set and non-empty), ``<cwd>/../shared/data`` and
        ``<repository root>/../shared/data``, as absolute paths without duplicates. The
        directories need not exist.
    """
    candidates: list[Path] = []
    env = os.environ.get(DATA_DIR_ENV, "")
    if env:
        candidates.append(Path(env).expanduser())
    try:
        candidates.append(Path.cwd() / ".." / "shared" / "data")
    except OSError:  # the working directory was deleted
        pass
    # parents: [0] data/, [1] fmtl_flower/, [2] repository root, [3] its parent.
    candidates.append(Path(__file__).resolve().parents[3] / "shared" / "data")
    unique: list[Path] = []
    for c in candidates:
        c = c.resolve()
        if c not in unique:
            unique.append(c)
    return tuple(unique)


def __getattr__(name: str) -> Any:
    """Compute ``DEFAULT_DATA_DIRS`` on access, so it follows the environment."""
    if name == "DEFAULT_DATA_DIRS":
        return default_data_dirs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset` (besides paths to ``.mat`` files).

    Returns
    -------
    list of str
        ``["synthetic", "small", "eat-voc"]``.
    """
    return [SYNTHETIC, *NAMED_FILES]


def _is_path_like(name_or_path: str | os.PathLike[str]) -> bool:
    """True for PathLike objects, strings ending in ``.mat`` or containing a separator."""
    if not isinstance(name_or_path, str):
        return True
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return name_or_path.lower().endswith(".mat") or any(s in name_or_path for s in seps)


def _unknown(name: Any) -> ValueError:
    return ValueError(
        f"unknown dataset {name!r}; known datasets are {available_datasets()}, "
        "or pass a path to a .mat file"
    )


def resolve_data_file(name_or_path: str | os.PathLike[str]) -> Path:
    """Find the file of a named dataset, or check a given path.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A key of :data:`NAMED_FILES` (``"small"``, ``"eat-voc"``), or a path: anything ending
        in ``.mat`` or containing a path separator.

    Returns
    -------
    Path
        The first existing candidate for a named dataset (see :func:`default_data_dirs`), or
        the given path (``~`` expanded).

    Raises
    ------
    FileNotFoundError
        If a named file is in none of the data directories (the message lists every path
        looked at and how to fix it), or a given path does not exist.
    ValueError
        If ``name_or_path`` is neither a named file nor path-like.
    """
    if isinstance(name_or_path, str) and name_or_path in NAMED_FILES:
        filename = NAMED_FILES[name_or_path]
        tried = [d / filename for d in default_data_dirs()]
        for candidate in tried:
            if candidate.is_file():
                return candidate
        looked = "\n  ".join(str(p) for p in tried)
        raise FileNotFoundError(
            f"data file {filename!r} for dataset {name_or_path!r} not found; looked in:\n"
            f"  {looked}\nSet {DATA_DIR_ENV} to the directory that holds it, or pass the "
            "path to the .mat file instead of the name"
        )
    if _is_path_like(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
        return path
    raise _unknown(name_or_path)


def load_dataset(
    name_or_path: str | os.PathLike[str] = SYNTHETIC,
    *,
    seed: int = 0,
    test_frac: float = 0.25,
    num_tasks: int | None = None,
    dim: int | None = None,
    samples_per_task: int | None = None,
) -> FederatedDataset:
    """Load or generate a federated multi-task dataset and split every task.

    Parameters
    ----------
    name_or_path : str or os.PathLike, default "synthetic"
        ``"synthetic"`` (generated), ``"small"``, ``"eat-voc"`` (files resolved with
        :func:`resolve_data_file`), or a path to a ``.mat`` file in one of the layouts of
        :func:`~fmtl_flower.data.mat.load_mat_tasks`.
    seed : int, default 0
        Non-negative run seed: it drives the generator (synthetic) and the per-task splits
        (task ``t`` uses ``np.random.default_rng([seed, t, 7])``).
    test_frac : float, default 0.25
        Per-class test fraction in [0, 1), see
        :func:`~fmtl_flower.data.split.train_test_split_task`.
    num_tasks, dim, samples_per_task : int, optional
        Generator overrides; only for ``"synthetic"`` (unset ones keep the generator's
        defaults).

    Returns
    -------
    FederatedDataset
        Named ``name_or_path`` for a named dataset, the file stem for a path. The same
        arguments always give identical arrays.

    Raises
    ------
    ValueError
        Unknown name (the message lists :func:`available_datasets`), generator overrides for
        a file dataset, invalid ``seed`` / ``test_frac`` / generator arguments, or an invalid
        file.
    FileNotFoundError
        If the data file cannot be found.
    """
    seed = _check_seed(seed)
    test_frac = _check_test_frac(test_frac)
    overrides = {
        k: v
        for k, v in zip(_GENERATOR_KEYS, (num_tasks, dim, samples_per_task), strict=True)
        if v is not None
    }
    if isinstance(name_or_path, str) and name_or_path == SYNTHETIC:
        Xs, ys = make_synthetic_tasks(**overrides, seed=seed)
        return split_tasks(Xs, ys, test_frac, seed, SYNTHETIC)
    if not (
        (isinstance(name_or_path, str) and name_or_path in NAMED_FILES)
        or _is_path_like(name_or_path)
    ):
        raise _unknown(name_or_path)
    if overrides:
        raise ValueError(
            f"{', '.join(overrides)} only apply to generated datasets ({SYNTHETIC!r}), "
            f"not to the file dataset {str(name_or_path)!r}"
        )
    path = resolve_data_file(name_or_path)
    is_named = isinstance(name_or_path, str) and name_or_path in NAMED_FILES
    name = str(name_or_path) if is_named else path.stem
    Xs, ys = load_mat_tasks(path)
    return split_tasks(Xs, ys, test_frac, seed, name)


def _freeze(dataset: FederatedDataset) -> FederatedDataset:
    """Make every array of ``dataset`` read-only (in place) and return it."""
    for task in dataset.tasks:
        for arr in task.arrays():
            arr.setflags(write=False)
    return dataset


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_cached(
    name_or_path: str | os.PathLike[str],
    seed: int,
    test_frac: float,
    num_tasks: int | None,
    dim: int | None,
    samples_per_task: int | None,
) -> FederatedDataset:
    return _freeze(
        load_dataset(
            name_or_path,
            seed=seed,
            test_frac=test_frac,
            num_tasks=num_tasks,
            dim=dim,
            samples_per_task=samples_per_task,
        )
    )


def load_dataset_cached(
    name_or_path: str | os.PathLike[str] = SYNTHETIC,
    *,
    seed: int = 0,
    test_frac: float = 0.25,
    num_tasks: int | None = None,
    dim: int | None = None,
    samples_per_task: int | None = None,
) -> FederatedDataset:
    """Like :func:`load_dataset`, but memoised in-process, with read-only arrays.

    The last 8 distinct argument combinations are kept (LRU); a repeated call returns the
    same :class:`FederatedDataset` object. All its arrays have ``writeable=False`` so that
    sharing is safe: copy an array before modifying it. A path is keyed as given (a ``str``
    and a ``Path`` to the same file are two entries); a file changed on disk is not re-read
    until :func:`clear_dataset_cache`.

    Parameters
    ----------
    name_or_path, seed, test_frac, num_tasks, dim, samples_per_task
        As for :func:`load_dataset`.

    Returns
    -------
    FederatedDataset

    Raises
    ------
    ValueError, FileNotFoundError
        As for :func:`load_dataset` (errors are not cached).
    """
    # Normalise the key (positional, validated seed/fraction) so that equivalent calls hit
    # the same entry; the generator overrides are validated by load_dataset.
    return _load_cached(
        name_or_path,
        _check_seed(seed),
        _check_test_frac(test_frac),
        num_tasks,
        dim,
        samples_per_task,
    )


def clear_dataset_cache() -> None:
    """Empty the cache of :func:`load_dataset_cached`."""
    _load_cached.cache_clear()
