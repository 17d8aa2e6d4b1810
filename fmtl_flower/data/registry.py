"""Dataset names, data-file resolution and the single entry point :func:`load_dataset`.

Named data files (``"small"``, ``"eat-voc"``) are looked for, in order, in

1. ``$FMTL_DATA_DIR`` if the variable is set and non-empty,
2. ``../shared/data`` relative to the current working directory,
3. ``../shared/data`` relative to the repository root (the checkout that holds this
   package; ``Path(__file__).resolve().parents[3] / "shared" / "data"``),

with duplicates removed. The list is recomputed on every look-up, so changing
``FMTL_DATA_DIR`` or the working directory takes effect immediately; the module attribute
``DEFAULT_DATA_DIRS`` is computed on access as well.

The MOCHA paper's datasets (``"har"``, ``"vehicle"``, ``"gleam"``, :data:`PAPER_DATASETS`)
are read from a local copy in their published layout, looked for in the same directories and
then in the download cache (:func:`~fmtl_flower.data.download.locate_dataset`); they are
downloaded only with ``download=True``.

The generated datasets are ``"synthetic"`` (MOCHA-style clustered tasks,
:func:`~fmtl_flower.data.synthetic.make_synthetic_tasks`) and ``"fedem-synthetic"`` (FedEM's
mixture dataset, :func:`~fmtl_flower.data.fedem_synthetic.make_fedem_synthetic`, with its own
train/test sets, a fixed generator seed and labels in ``{0, 1}``), ``"digits-dirichlet"``
(scikit-learn's bundled digits, 10 classes, split among ``num_tasks`` devices (default 10)
by Dirichlet(0.5) label skew: :mod:`fmtl_flower.data.digits`) and ``"sparse-federated"``
(the FSVRG paper's setting: sparse, unbalanced, non-IID nodes,
:func:`~fmtl_flower.data.sparse_federated.make_sparse_federated`; returned as a
:class:`~fmtl_flower.data.sparse_federated.SparseFederatedDataset` with CSR design matrices;
``num_tasks`` (K, default 1000), ``dim`` (default 20,000) and ``iid`` (default False: the
paper's FSVRGR reshuffle when True) apply).

Large generated federations are lazy (:mod:`fmtl_flower.data.lazy`): ``"synthetic"`` above
2,000 tasks and non-IID ``"sparse-federated"`` above 10,000 nodes (or with ``lazy=True``) give
a dataset whose task ``t`` is generated when accessed, bit-identical to the eager one.

The data files are never copied: they are read where they are.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fmtl_flower.data.arguments import takes_arguments_of
from fmtl_flower.data.dataset import LoadedTasks, MultiTaskDataset, TaskData, _freeze_task
from fmtl_flower.data.digits import DIGITS_DIRICHLET, make_digits_dirichlet
from fmtl_flower.data.download import locate_dataset
from fmtl_flower.data.fedem_synthetic import _check_generator, make_fedem_synthetic
from fmtl_flower.data.gleam import load_gleam_tasks
from fmtl_flower.data.har import load_har_tasks
from fmtl_flower.data.lazy import lazy_sparse_federated, lazy_synthetic, use_lazy
from fmtl_flower.data.mat import load_mat_tasks
from fmtl_flower.data.paths import DATA_DIR_ENV, default_data_dirs
from fmtl_flower.data.skew import check_skew_ratio, skew_dataset
from fmtl_flower.data.sparse_federated import (
    SparseFederatedDataset,
    make_sparse_federated,
    size_params,
)
from fmtl_flower.data.split import _check_seed, _check_test_frac, split_tasks
from fmtl_flower.data.synthetic import synthetic_source
from fmtl_flower.data.validation import validate_task
from fmtl_flower.data.vehicle import load_vehicle_tasks

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIRS",
    "FEDEM_SYNTHETIC",
    "FEDEM_SYNTHETIC_SEED",
    "NAMED_FILES",
    "PAPER_DATASETS",
    "SPARSE_FEDERATED",
    "SPARSE_FEDERATED_DEFAULTS",
    "SYNTHETIC",
    "available_datasets",
    "clear_dataset_cache",
    "default_data_dirs",
    "load_dataset",
    "load_dataset_cached",
    "resolve_data_file",
]

#: Name of the generated dataset (:func:`~fmtl_flower.data.synthetic.make_synthetic_tasks`).
SYNTHETIC = "synthetic"

#: Name of FedEM's synthetic dataset
#: (:func:`~fmtl_flower.data.fedem_synthetic.make_fedem_synthetic`).
FEDEM_SYNTHETIC = "fedem-synthetic"

#: Name of the FSVRG-style sparse federated dataset
#: (:func:`~fmtl_flower.data.sparse_federated.make_sparse_federated`).
SPARSE_FEDERATED = "sparse-federated"

#: What unset ``"sparse-federated"`` arguments mean (used to normalise cache keys).
SPARSE_FEDERATED_DEFAULTS: dict[str, Any] = {"num_tasks": 1000, "dim": 20_000, "iid": False}

#: What an unset ``"synthetic"`` ``num_tasks`` means (the default of
#: :func:`~fmtl_flower.data.synthetic.make_synthetic_tasks`); decides ``lazy=None``.
_SYNTHETIC_DEFAULTS: dict[str, Any] = {"num_tasks": 30}

#: Seed of the FedEM synthetic generator (the paper's data, whatever the run seed).
FEDEM_SYNTHETIC_SEED = 12345

#: Named data files and their file names inside a data directory.
NAMED_FILES: dict[str, str] = {"small": "small.mat", "eat-voc": "EAT_VOC.mat"}

#: The MOCHA paper's datasets and their loaders (each returns
#: :class:`~fmtl_flower.data.dataset.LoadedTasks`; see :mod:`fmtl_flower.data.har`,
#: :mod:`fmtl_flower.data.vehicle`, :mod:`fmtl_flower.data.gleam`).
PAPER_DATASETS: dict[str, Callable[..., LoadedTasks]] = {
    "har": load_har_tasks,
    "vehicle": load_vehicle_tasks,
    "gleam": load_gleam_tasks,
}

#: Arguments of :func:`load_dataset` that only apply to generated datasets.
_GENERATOR_KEYS = ("num_tasks", "dim", "samples_per_task")

#: Arguments of :func:`load_dataset` that only apply to ``"fedem-synthetic"``.
_FEDEM_KEYS = ("generator", "n_test")

#: Arguments of :func:`load_dataset` that ``"fedem-synthetic"`` does not accept.
_FEDEM_REJECTED = ("samples_per_task", "skew")

#: What unset ``"fedem-synthetic"`` arguments mean (the defaults of
#: :func:`~fmtl_flower.data.fedem_synthetic.make_fedem_synthetic`); used to normalise cache
#: keys.
_FEDEM_DEFAULTS: dict[str, Any] = {
    "num_tasks": 300,
    "dim": 150,
    "n_test": 5000,
    "generator": "released",
}

_CACHE_SIZE = 8

if TYPE_CHECKING:
    DEFAULT_DATA_DIRS: tuple[Path, ...]


def __getattr__(name: str) -> Any:
    """Compute ``DEFAULT_DATA_DIRS`` on access, so it follows the environment."""
    if name == "DEFAULT_DATA_DIRS":
        return default_data_dirs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset` (besides paths to ``.mat`` files).

    Whether a named dataset can actually be loaded depends on its files being present (or,
    for the paper datasets, on ``download=True`` and a network).

    Returns
    -------
    list of str
        ``["synthetic", "fedem-synthetic", "sparse-federated", "digits-dirichlet", "small",
        "eat-voc", "har", "vehicle", "gleam"]``. ``"sparse-federated"`` (the FSVRG
        generator) gives a :class:`~fmtl_flower.data.sparse_federated.SparseFederatedDataset`
        (CSR features) rather than a :class:`MultiTaskDataset`; ``"digits-dirichlet"``
        (:mod:`fmtl_flower.data.digits`) has labels 0..9.
    """
    return [SYNTHETIC, FEDEM_SYNTHETIC, SPARSE_FEDERATED, DIGITS_DIRICHLET, *NAMED_FILES,
            *PAPER_DATASETS]


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


def _is_paper(name_or_path: Any) -> bool:
    return isinstance(name_or_path, str) and name_or_path in PAPER_DATASETS


def resolve_data_file(name_or_path: str | os.PathLike[str]) -> Path:
    """Find the file of a named dataset, or check a given path.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A key of :data:`NAMED_FILES` (``"small"``, ``"eat-voc"``) or of
        :data:`PAPER_DATASETS` (``"har"``, ``"vehicle"``, ``"gleam"``), or a path: anything
        ending in ``.mat`` or containing a path separator.

    Returns
    -------
    Path
        The first existing candidate for a named dataset (see :func:`default_data_dirs`; for
        a paper dataset, :func:`~fmtl_flower.data.download.locate_dataset`, which never
        downloads here), or the given path (``~`` expanded).

    Raises
    ------
    FileNotFoundError
        If a named file is in none of the data directories (the message lists every path
        looked at and how to fix it), or a given path does not exist.
    ValueError
        If ``name_or_path`` is neither a named dataset nor path-like.
    """
    if _is_paper(name_or_path):
        return locate_dataset(str(name_or_path))
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


def _is_fedem(name_or_path: Any) -> bool:
    return isinstance(name_or_path, str) and name_or_path == FEDEM_SYNTHETIC


def _load_fedem(
    num_tasks: int | None,
    dim: int | None,
    samples_per_task: int | None,
    skew: float | None,
    generator: str | None,
    n_test: int | None,
) -> MultiTaskDataset:
    """Generate ``"fedem-synthetic"`` (see :func:`load_dataset`)."""
    rejected = [
        k for k, v in zip(_FEDEM_REJECTED, (samples_per_task, skew), strict=True) if v is not None
    ]
    if rejected:
        raise ValueError(
            f"{', '.join(rejected)} cannot be used with {FEDEM_SYNTHETIC!r}: its training-set "
            "sizes and its train/test sets are drawn by FedEM's generator (accepted overrides: "
            "num_tasks, dim, n_test, generator)"
        )
    overrides = {
        k: v
        for k, v in (("num_tasks", num_tasks), ("dim", dim), ("n_test", n_test))
        if v is not None
    }
    data = make_fedem_synthetic(
        **overrides,
        seed=FEDEM_SYNTHETIC_SEED,
        generator=_FEDEM_DEFAULTS["generator"] if generator is None else generator,
    )
    tasks = []
    for t, (X_train, y_train, X_test, y_test) in enumerate(data.tasks):
        name = f"{FEDEM_SYNTHETIC}: task {t}"
        X_train, y_train = validate_task(X_train, y_train, labels="01", name=f"{name} (train)")
        X_test, y_test = validate_task(X_test, y_test, labels="01", name=f"{name} (test)")
        tasks.append(TaskData(X_train, y_train, X_test, y_test))
    return MultiTaskDataset(FEDEM_SYNTHETIC, tasks)


def _is_sparse(name_or_path: Any) -> bool:
    return isinstance(name_or_path, str) and name_or_path == SPARSE_FEDERATED


def _load_sparse(
    seed: int,
    test_frac: float,
    num_tasks: int | None,
    dim: int | None,
    samples_per_task: int | None,
    skew: float | None,
    iid: bool | None,
    lazy: bool | None = None,
) -> SparseFederatedDataset:
    """Generate ``"sparse-federated"`` (see :func:`load_dataset`)."""
    if skew is not None:
        raise ValueError(
            f"skew cannot be used with {SPARSE_FEDERATED!r}: its node sizes "
            "are drawn by its generator (accepted overrides: num_tasks, dim, "
            "samples_per_task, iid)"
        )
    sizes = {} if samples_per_task is None else size_params(samples_per_task)
    if iid is not None and not isinstance(iid, bool | np.bool_):
        raise ValueError(f"iid must be a bool, got {iid!r}")
    num_tasks = SPARSE_FEDERATED_DEFAULTS["num_tasks"] if num_tasks is None else num_tasks
    dim = SPARSE_FEDERATED_DEFAULTS["dim"] if dim is None else dim
    iid = SPARSE_FEDERATED_DEFAULTS["iid"] if iid is None else bool(iid)
    if _resolve_lazy(SPARSE_FEDERATED, num_tasks, lazy, iid):
        return lazy_sparse_federated(
            num_tasks, dim=dim, seed=seed, test_frac=test_frac, name=SPARSE_FEDERATED, **sizes
        )
    return make_sparse_federated(
        num_tasks, dim=dim, seed=seed, test_frac=test_frac, iid=iid, name=SPARSE_FEDERATED,
        **sizes
    )


def _resolve_lazy(name_or_path: Any, num_tasks: Any, lazy: Any, iid: Any = None) -> bool:
    """Whether :func:`load_dataset` builds the dataset lazily: the answer of
    :func:`~fmtl_flower.data.lazy.use_lazy` (and its ValueError for a ``lazy`` that is not a
    bool or None, or ``lazy=True`` for a dataset that cannot be lazy) for ``num_tasks`` tasks
    (None: the generator's default; not an int: 0, which the generator's own validation
    reports when the dataset is built) and ``iid`` (``"sparse-federated"``; None: False).
    """
    if num_tasks is None:
        if isinstance(name_or_path, str) and name_or_path == SYNTHETIC:
            num_tasks = _SYNTHETIC_DEFAULTS["num_tasks"]
        elif _is_sparse(name_or_path):
            num_tasks = SPARSE_FEDERATED_DEFAULTS["num_tasks"]
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, int | np.integer):
        num_tasks = 0
    return use_lazy(str(name_or_path), int(num_tasks), lazy, iid=bool(iid))


def load_dataset(
    name_or_path: str | os.PathLike[str] = SYNTHETIC,
    *,
    seed: int = 0,
    test_frac: float = 0.25,
    num_tasks: int | None = None,
    dim: int | None = None,
    samples_per_task: int | None = None,
    skew: float | None = None,
    data_path: str | os.PathLike[str] | None = None,
    download: bool = False,
    generator: str | None = None,
    n_test: int | None = None,
    iid: bool | None = None,
    lazy: bool | None = None,
) -> MultiTaskDataset | SparseFederatedDataset:
    """Load or generate a federated multi-task dataset and split every task.

    Parameters
    ----------
    name_or_path : str or os.PathLike, default "synthetic"
        ``"synthetic"`` (generated), ``"fedem-synthetic"`` (FedEM's generated mixture dataset,
        see below), ``"small"``, ``"eat-voc"`` (files resolved with
        :func:`resolve_data_file`), ``"har"``, ``"vehicle"``, ``"gleam"`` (the MOCHA paper's
        datasets, read from a local copy in their published layout, see
        :data:`PAPER_DATASETS`), or a path to a ``.mat`` file in one of the layouts of
        :func:`~fmtl_flower.data.mat.load_mat_tasks`.
    seed : int, default 0
        Non-negative run seed: it drives the generator (synthetic), the per-task splits
        (task ``t`` uses ``np.random.default_rng([seed, t, 7])``) and the skew. It does not
        change ``"fedem-synthetic"``, whose generator always uses the paper's seed
        :data:`FEDEM_SYNTHETIC_SEED` (12345): the run seed drives training only, the data are
        the paper's.
    test_frac : float, default 0.25
        Per-class test fraction in [0, 1), see
        :func:`~fmtl_flower.data.split.train_test_split_task`. Ignored (but still validated)
        for ``"fedem-synthetic"``, whose generator draws its own training (``n_t`` samples)
        and test (``n_test`` samples) sets.
    num_tasks, dim : int, optional
        Generator overrides for ``"synthetic"`` and ``"fedem-synthetic"`` (unset ones keep
        the generator's defaults: 30 tasks and ``d = 20`` for ``"synthetic"``, 300 tasks and
        ``d = 150`` for ``"fedem-synthetic"``).
    samples_per_task : int, optional
        Generator override for ``"synthetic"`` (median samples per task) and
        ``"sparse-federated"`` (median rows per node before the split, through
        :func:`~fmtl_flower.data.sparse_federated.size_params`; unset: the paper-like
        default sizes, median about 71).
    skew : float, optional
        If given (a ratio >= 1, the paper's is 100), subsample each task's training part
        after the split so that training-set sizes differ by about this ratio (MOCHA appendix
        E.2, Table 3), with :func:`~fmtl_flower.data.skew.skew_dataset` and this ``seed``;
        test parts are unchanged. None (default): no skew. Not accepted for
        ``"fedem-synthetic"``.
    data_path : str or os.PathLike, optional
        Where the named dataset's local copy is (a ``.mat`` file for ``"small"`` /
        ``"eat-voc"``; a directory or archive for the paper datasets), instead of looking in
        the data directories.
    download : bool, default False
        For the paper datasets only: if no local copy is found, download it into the cache
        first (:func:`~fmtl_flower.data.download.download_dataset`). Never implicit.
    generator : {"released", "fixed"}, optional
        For ``"fedem-synthetic"`` only: ``"released"`` (default) reproduces the authors'
        generator including its labelling bug, ``"fixed"`` the described mixture (see
        :mod:`fmtl_flower.data.fedem_synthetic`).
    n_test : int, optional
        For ``"fedem-synthetic"`` only: test samples per task (default 5000, the paper's;
        the full dataset then holds 1.8 GB of test data, use a small value in tests).
    iid : bool, optional
        For ``"sparse-federated"`` only: ``True`` reshuffles the same rows IID across the same
        node sizes (the paper's FSVRGR); default ``False`` (the non-IID nodes). For
        ``"sparse-federated"``, ``num_tasks`` is the number of nodes K (default 1000) and
        ``dim`` the number of features (default 20,000); ``seed`` drives the generator and
        ``test_frac`` the per-node split.
    lazy : bool, optional
        For ``"synthetic"`` and non-IID ``"sparse-federated"``: generate (and split, skew)
        task ``t`` only when it is accessed (:mod:`fmtl_flower.data.lazy`), so that a large
        federation is never in memory at once; task ``t`` is bit-identical to the eager
        dataset's, with read-only arrays. None (default): lazy above
        :data:`~fmtl_flower.data.lazy.LAZY_SYNTHETIC_ABOVE` (2,000) tasks /
        :data:`~fmtl_flower.data.lazy.LAZY_SPARSE_ABOVE` (10,000) nodes; ``False`` always
        builds every task; ``True`` is an error for the other datasets and for ``iid=True``.

    Returns
    -------
    MultiTaskDataset or SparseFederatedDataset
        Named ``name_or_path`` for a named dataset, the file stem for a path. The same
        arguments always give identical arrays. A lazy one is a
        :class:`~fmtl_flower.data.lazy.LazyFederatedDataset` /
        :class:`~fmtl_flower.data.lazy.LazySparseFederatedDataset` (``dataset.lazy`` is
        True). Labels are in ``{-1, +1}``, except for
        ``"fedem-synthetic"`` (``{0, 1}``, FedEM's convention). ``"sparse-federated"``
        gives a :class:`~fmtl_flower.data.sparse_federated.SparseFederatedDataset` (CSR
        design matrices, same attribute names).

    Raises
    ------
    ValueError
        Unknown name (the message lists :func:`available_datasets`), generator overrides for
        a file dataset, ``generator`` / ``n_test`` for a dataset other than
        ``"fedem-synthetic"``, ``samples_per_task`` / ``skew`` for ``"fedem-synthetic"``
        (``skew`` for ``"sparse-federated"``),
        ``data_path`` for a generated dataset or a path, ``download`` for a dataset that is
        not a paper dataset, ``lazy=True`` for a dataset that cannot be lazy, invalid
        ``seed`` / ``test_frac`` / ``skew`` / ``lazy`` / generator arguments, or an invalid
        file.
    FileNotFoundError
        If the data cannot be found (the message says where it looked and how to get it).
    """
    return _load(_Request(name_or_path, seed, test_frac, num_tasks, dim, samples_per_task, skew,
                          data_path, download, generator, n_test, iid, lazy).checked())


@dataclass(frozen=True)
class _Request:
    """The arguments of :func:`load_dataset` (and of :func:`load_dataset_cached`), one value:
    the cache's key and what :func:`_load` reads."""

    name_or_path: Any
    seed: Any
    test_frac: Any
    num_tasks: Any
    dim: Any
    samples_per_task: Any
    skew: Any
    data_path: Any
    download: Any
    generator: Any
    n_test: Any
    iid: Any
    lazy: Any

    def checked(self) -> _Request:
        """``seed``, ``test_frac`` and ``skew`` validated (ValueError naming the argument)."""
        skew = None if self.skew is None else check_skew_ratio(self.skew)
        return replace(self, seed=_check_seed(self.seed),
                       test_frac=_check_test_frac(self.test_frac), skew=skew)

    def cache_key(self) -> _Request:
        """The request with what equivalent calls spell differently made equal: for
        ``"fedem-synthetic"`` no seed or fraction and its defaults spelled out, for
        ``"sparse-federated"`` its defaults spelled out, ``lazy`` the choice it stands for
        (kept as given when it is invalid: :func:`load_dataset` raises, errors are not
        cached)."""
        key = replace(self, download=bool(self.download))
        if _is_fedem(key.name_or_path):
            key = replace(key, seed=0, test_frac=0.0, **{
                k: _FEDEM_DEFAULTS[k] if getattr(key, k) is None else getattr(key, k)
                for k in ("num_tasks", "dim", "n_test", "generator")})
        if _is_sparse(key.name_or_path):
            key = replace(key, **{
                k: SPARSE_FEDERATED_DEFAULTS[k] if getattr(key, k) is None else getattr(key, k)
                for k in ("num_tasks", "dim", "iid")})
        try:
            return replace(key, lazy=_resolve_lazy(key.name_or_path, key.num_tasks, key.lazy,
                                                   key.iid))
        except ValueError:
            return key


def _kind(name_or_path: Any) -> str:
    """``"synthetic"``, ``"fedem"``, ``"sparse"``, ``"named"``, ``"paper"`` or ``"path"``;
    ValueError (listing the names) for anything else."""
    named = isinstance(name_or_path, str)
    for kind, hit in (("synthetic", named and name_or_path == SYNTHETIC),
                      ("fedem", _is_fedem(name_or_path)), ("sparse", _is_sparse(name_or_path)),
                      ("digits", named and name_or_path == DIGITS_DIRICHLET),
                      ("named", named and name_or_path in NAMED_FILES),
                      ("paper", _is_paper(name_or_path)),
                      ("path", _is_path_like(name_or_path))):
        if hit:
            return kind
    raise _unknown(name_or_path)


def _check_applicable(req: _Request, kind: str) -> None:
    """The arguments that apply to some datasets only: a ValueError naming the first that
    ``req`` gives to a dataset it does not apply to (and an invalid ``generator`` or
    ``lazy``)."""
    shown = str(req.name_or_path)
    fedem_args = [k for k in _FEDEM_KEYS if getattr(req, k) is not None]
    if req.iid is not None and kind != "sparse":
        raise ValueError(f"iid only applies to {SPARSE_FEDERATED!r}, not to {shown!r}")
    if fedem_args and kind != "fedem":
        raise ValueError(f"{', '.join(fedem_args)} only apply to {FEDEM_SYNTHETIC!r}, "
                         f"not to {shown!r}")
    if req.generator is not None:
        _check_generator(req.generator)
    if req.download and kind != "paper":
        raise ValueError(f"download=True only applies to the paper datasets "
                         f"{list(PAPER_DATASETS)}, not to {shown!r}")
    if req.data_path is not None and kind not in ("named", "paper"):
        raise ValueError(f"data_path only applies to named datasets "
                         f"({[*NAMED_FILES, *PAPER_DATASETS]}), not to {shown!r}")
    # validate lazy now (sparse-federated decides once its arguments are checked): raises
    # for a non-bool, or for lazy=True and a dataset that cannot be lazy (saying why)
    _resolve_lazy(req.name_or_path, 0, req.lazy)


def _load(req: _Request) -> MultiTaskDataset | SparseFederatedDataset:
    """:func:`load_dataset` for a checked request."""
    kind = _kind(req.name_or_path)
    _check_applicable(req, kind)
    if kind == "fedem":
        return _load_fedem(req.num_tasks, req.dim, req.samples_per_task, req.skew,
                           req.generator, req.n_test)
    if kind == "sparse":
        return _load_sparse(req.seed, req.test_frac, req.num_tasks, req.dim,
                            req.samples_per_task, req.skew, req.iid, req.lazy)
    overrides = {k: getattr(req, k) for k in _GENERATOR_KEYS if getattr(req, k) is not None}
    if kind == "digits":
        dataset = _load_digits(req, overrides)
    elif kind == "synthetic":
        source = synthetic_source(**overrides, seed=req.seed)
        if _resolve_lazy(SYNTHETIC, source.num_tasks, req.lazy):
            return lazy_synthetic(source, test_frac=req.test_frac, seed=req.seed,
                                  name=SYNTHETIC, skew=req.skew)
        Xs, ys = source.draw_all()
        dataset = split_tasks(Xs, ys, req.test_frac, req.seed, SYNTHETIC)
    else:
        if overrides:
            raise ValueError(
                f"{', '.join(overrides)} only apply to generated datasets "
                f"({SYNTHETIC!r}, {FEDEM_SYNTHETIC!r}), "
                f"not to the file dataset {str(req.name_or_path)!r}"
            )
        name, Xs, ys = _read_files(req, kind)
        dataset = split_tasks(Xs, ys, req.test_frac, req.seed, name)
    if req.skew is not None:
        dataset = skew_dataset(dataset, ratio=req.skew, seed=req.seed)
    return dataset


def _load_digits(req: _Request, overrides: dict[str, Any]) -> MultiTaskDataset:
    """``"digits-dirichlet"`` (:mod:`fmtl_flower.data.digits`): ``num_tasks`` devices
    (default 10), ``seed`` and ``test_frac`` apply; ``dim`` and ``samples_per_task`` do
    not."""
    rejected = [k for k in overrides if k != "num_tasks"]
    if rejected:
        raise ValueError(f"{', '.join(rejected)} cannot be used with {DIGITS_DIRICHLET!r} "
                         "(64 pixel features; its devices' sizes come from the split)")
    return make_digits_dirichlet(overrides.get("num_tasks", 10), seed=req.seed,
                                 test_frac=req.test_frac)


def _read_files(req: _Request, kind: str) -> tuple[str, list, list]:
    """(name, Xs, ys) of a paper dataset's local copy, a named ``.mat`` file or a path."""
    if kind == "paper":
        loaded = PAPER_DATASETS[str(req.name_or_path)](req.data_path, download=req.download)
        return str(req.name_or_path), loaded.Xs, loaded.ys
    if req.data_path is not None:
        path = Path(req.data_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
    else:
        path = resolve_data_file(req.name_or_path)
    name = str(req.name_or_path) if kind == "named" else path.stem
    Xs, ys = load_mat_tasks(path)
    return name, Xs, ys


def _freeze(
    dataset: MultiTaskDataset | SparseFederatedDataset,
) -> MultiTaskDataset | SparseFederatedDataset:
    """Make every array of ``dataset`` read-only (in place) and return it (a lazy dataset's
    arrays are read-only already: its tasks are not generated here)."""
    if dataset.lazy:
        return dataset
    for task in dataset.tasks:
        _freeze_task(task)
    return dataset


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_cached(req: _Request) -> MultiTaskDataset | SparseFederatedDataset:
    return _freeze(_load(req))


@takes_arguments_of(load_dataset)
def load_dataset_cached(**arguments: Any) -> MultiTaskDataset | SparseFederatedDataset:
    """Like :func:`load_dataset`, but memoised in-process, with read-only arrays.

    The last 8 distinct argument combinations are kept (LRU); a repeated call returns the
    same :class:`MultiTaskDataset` object. All its arrays have ``writeable=False`` so that
    sharing is safe: copy an array before modifying it. A path is keyed as given (a ``str``
    and a ``Path`` to the same file are two entries); a file changed on disk is not re-read
    until :func:`clear_dataset_cache`. For ``"fedem-synthetic"``, whose data depend on
    neither ``seed`` nor ``test_frac``, calls that differ only in those (or in spelling a
    default out, e.g. ``generator="released"``) share one entry, so runs with different
    seeds hold the paper-sized dataset (about 1.9 GB) once.

    Parameters
    ----------
    name_or_path, seed, test_frac, num_tasks, dim, samples_per_task, skew
        As for :func:`load_dataset`.
    data_path, download, generator, n_test, iid, lazy
        As for :func:`load_dataset`. For ``"sparse-federated"``, unset ``num_tasks`` /
        ``dim`` / ``iid`` and their spelled-out defaults share one entry (the CSR arrays
        are read-only too). ``lazy=None`` and the choice it stands for share one entry. A
        lazy dataset (:mod:`fmtl_flower.data.lazy`) is cached as the small lazy object (its
        last 64 accessed tasks and its size arrays), not as all its tasks.

    Returns
    -------
    MultiTaskDataset or SparseFederatedDataset

    Raises
    ------
    ValueError, FileNotFoundError
        As for :func:`load_dataset` (errors are not cached).
    """
    return _load_cached(_Request(**arguments).checked().cache_key())


def clear_dataset_cache() -> None:
    """Empty the cache of :func:`load_dataset_cached`."""
    _load_cached.cache_clear()
