"""Multi-class MOCHA by one-vs-rest with one Omega for all classes, and the intercept: the
block lifting that turns them into the binary problem the SDCA kernel, the dual, sigma', the
certificate and the server already solve (Flower-free; the maths is in
``docs/guides/mocha.md``, section "Multi-class and intercept").

The lifting. The run's classes c_0 < ... < c_{K-1} are agreed at discovery. Sample i of task
t (features x_i in R^d, label y_i) becomes K samples (i, k), k = 0..K-1: features
e_k (x) x_i in R^{dK} (x_i in block k, zeros elsewhere) and label +1 if y_i = c_k else -1.
Task t's model w_t in R^{dK} is K blocks w_tk in R^d; its loss is the mean over the nK
lifted samples, (1 / nK) sum_{i,k} l(y_ik w_tk . x_i), so the lifted problem is MOCHA's with
d*K features and n*K samples; the loss l is whatever the kernel uses (the lifting only
changes X and y). Omega, learned from W (dK x m), couples the tasks by all classes at once;
with Omega fixed, tr(W Omega W^T) = sum_k tr(W_k Omega W_k^T), so the problem splits into the
K binary one-vs-rest problems, each with lambda * K (the 1 / K of the mean over classes moved
to the regulariser). A prediction is argmax_k w_tk . x.

K = 2 is the binary problem of today, not lifted: c_0 -> -1, c_1 -> +1 (for the labels
{-1, +1} and {0, 1} exactly today's mapping).

The intercept: a constant feature of value ``scaling`` appended to every row (test rows
too) before the lifting, so each class block gets a bias b_k = scaling * w_k[d]; it is
penalised like every other weight (as in scikit-learn's liblinear ``intercept_scaling``).
An unpenalised bias would add the equality constraint sum_i alpha_i y_i = 0 to the dual,
which SDCA's one-coordinate steps cannot keep (each step moves one alpha_i alone).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .robust import log_upper_fence

__all__ = [
    "Lifting",
    "MAX_CLASS_NAME",
    "class_indices",
    "class_kind",
    "decide_classes",
    "label_values",
    "lift",
    "multiclass_errors",
    "natural_binary",
    "predict_classes",
    "wire_list",
    "with_intercept",
]

#: Longest label (as a string) a device may report at discovery.
MAX_CLASS_NAME = 200
#: Most bytes a device's materialised lifting may take (n K rows of d K float64 entries:
#: K**2 times its data); more is refused with a clear error rather than exhausting memory.
MAX_LIFTED_BYTES = 2 ** 31

Label = int | float | str
KIND_NAMES = {"str": "strings", "number": "numbers"}


@dataclass(frozen=True)
class Lifting:
    """What a run's devices do to their data before MOCHA sees it.

    Attributes
    ----------
    classes : tuple or None
        The run's sorted class list, None for today's binary labels (-1/+1, or 0/1 taken as
        -1/+1 by ``labels="auto"``). Two classes: binary (c_0 -> -1, c_1 -> +1); more: the
        one-vs-rest lifting over K blocks.
    intercept_scaling : float
        The constant feature appended to every row (0: no intercept).
    """

    classes: tuple[Label, ...] | None = None
    intercept_scaling: float = 0.0

    @property
    def blocks(self) -> int:
        """K for a multi-class run, 1 for a binary one."""
        return 1 if self.classes is None or len(self.classes) <= 2 else len(self.classes)

    @property
    def is_identity(self) -> bool:
        """True when the devices' data are used as they are (today's binary run)."""
        return self.classes is None and self.intercept_scaling == 0.0

    def dim(self, d: int) -> int:
        """The model dimension of ``d`` features: (d + 1 with an intercept) * K."""
        return (int(d) + (self.intercept_scaling > 0)) * self.blocks

    def n(self, n: Any) -> Any:
        """The number of lifted samples of ``n`` samples (scalar or array)."""
        return n * self.blocks

    def row_norm(self, norm: Any) -> Any:
        """The largest lifted row norm of rows of norm at most ``norm``: the intercept's
        constant adds ``scaling**2`` under the root; the lifting keeps norms."""
        return np.sqrt(np.square(norm) + self.intercept_scaling ** 2) \
            if self.intercept_scaling else norm

    def config(self) -> dict[str, Any]:
        """The message config keys that tell a device this lifting (none for the identity):
        ``classes`` (list of int, float or str) and ``intercept-scaling`` (float > 0)."""
        out: dict[str, Any] = {}
        if self.classes is not None:
            out["classes"] = wire_list(self.classes)
        if self.intercept_scaling:
            out["intercept-scaling"] = float(self.intercept_scaling)
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Lifting:
        """The lifting a message's config describes (:meth:`config`); ValueError if its
        values are malformed."""
        classes = None
        if "classes" in config:
            value = config["classes"]
            if not isinstance(value, list | tuple) or len(value) < 2:
                raise ValueError(f"message config 'classes' must be a list of at least 2 "
                                 f"labels, got {value!r}")
            classes = canonical_classes(value)
            if len(classes) != len(value):
                raise ValueError("message config 'classes' has repeated labels")
        scaling = 0.0
        if "intercept-scaling" in config:
            scaling = config["intercept-scaling"]
            if isinstance(scaling, bool) or not isinstance(scaling, int | float) \
                    or not (math.isfinite(scaling) and scaling > 0):
                raise ValueError("message config 'intercept-scaling' must be a finite number "
                                 f"> 0, got {scaling!r}")
        return cls(classes, float(scaling))


# ---------------------------------------------------------------------- labels and classes
def _canonical(value: Any) -> Label:
    """A label as a plain Python value: numbers as int when integral (1.0 and 1 are one
    class; booleans are 0/1), else float; strings (and bytes, decoded) as str."""
    if isinstance(value, bytes | np.bytes_):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, str | np.str_):
        return str(value)
    if isinstance(value, bool | np.bool_):
        return int(value)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"labels must be finite, got {value!r}")
    return int(number) if number == round(number) and abs(number) < 2 ** 53 else number


def class_kind(values: Iterable[Label]) -> str:
    """``"str"`` when every label is a string, ``"number"`` when none is; ValueError for a
    mix (a federation's classes are of one kind)."""
    kinds = {"str" if isinstance(v, str) else "number" for v in values}
    if len(kinds) > 1:
        raise ValueError("labels mix strings and numbers")
    return kinds.pop() if kinds else "number"


def canonical_classes(values: Iterable[Any]) -> tuple[Label, ...]:
    """The distinct labels of ``values``, canonical (:func:`_canonical`) and sorted."""
    distinct = {_canonical(v) for v in values}
    class_kind(distinct)
    return tuple(sorted(distinct))


def label_values(*label_arrays: Any) -> list[Label]:
    """The sorted distinct labels of a device's label arrays, as a homogeneous list a
    ConfigRecord holds (ints, floats or strs; ints become floats when floats are among
    them): what a device reports at discovery as ``classes``."""
    values: set[Label] = set()
    for labels in label_arrays:
        array = np.asarray(labels)
        if array.size:
            values.update(_canonical(v) for v in np.unique(array).tolist())
    return wire_list(canonical_classes(values))


def wire_list(classes: Sequence[Label]) -> list[Label]:
    """``classes`` as a list a ConfigRecord holds: of one type (ints become floats when
    floats are among them)."""
    if any(isinstance(v, float) for v in classes):
        return [float(v) for v in classes]
    return list(classes)


def natural_binary(classes: Sequence[Label]) -> bool:
    """True when every device maps ``classes`` alike without being told: a subset of
    {-1, +1} or of {0, 1} (today's binary labels, ``labels="auto"`` takes 0/1 as -1/+1)."""
    values = set(classes)
    return values <= {-1, 1} or values <= {0, 1}


def class_indices(labels: Any, classes: Sequence[Label], name: str) -> np.ndarray:
    """Each label's index in ``classes`` (int64); ValueError naming the labels outside
    them."""
    index = {c: k for k, c in enumerate(classes)}
    array = np.asarray(labels).reshape(-1)
    out = np.empty(array.shape[0], dtype=np.int64)
    distinct, inverse = np.unique(array, return_inverse=True)
    missing = []
    for j, value in enumerate(distinct.tolist()):
        k = index.get(_canonical(value), -1)
        if k < 0:
            missing.append(value)
        out[inverse.reshape(-1) == j] = k
    if missing:
        raise ValueError(f"{name}: labels {missing[:5]} are not among the run's classes "
                         f"{list(classes)[:20]}")
    return out


def decide_classes(votes: Mapping[int, Sequence[Label]], robust: bool, max_classes: int
                   ) -> tuple[tuple[Label, ...], dict[int, str]]:
    """The run's sorted class list from the nodes' label sets (one vote per physical node)
    and the nodes refused, with why.

    Every class some admitted node holds is a class (label skew: a class one device alone
    holds is still one). A node is refused when its labels are of the other kind than the
    majority's (strings vs numbers) or, in robust mode, when it claims more classes than
    the log-scale upper fence of the nodes' class counts
    (:func:`~fmtl_flower.core.robust.log_upper_fence`: 10 times their median, more only
    when the honest counts spread that widely). If the union still exceeds ``max_classes``
    (many nodes each claiming other classes) the ``max_classes`` classes held by the most
    nodes are kept (ties: in sorted order); a device holding another label then fails its
    messages with a reason naming it.
    """
    if not votes:
        return (), {}
    refused: dict[int, str] = {}
    kinds = {node: class_kind(vote) for node, vote in votes.items()}
    majority = Counter(kinds.values()).most_common(1)[0][0]
    for node, kind in kinds.items():
        if kind != majority:
            refused[node] = f"labels are {KIND_NAMES[kind]}, the federation's " \
                            f"{KIND_NAMES[majority]}"
    kept = {node: vote for node, vote in votes.items() if node not in refused}
    if robust and kept:
        fence = log_upper_fence(np.array([len(v) for v in kept.values()], dtype=np.float64))
        for node, vote in kept.items():
            if len(vote) > fence:
                refused[node] = (f"{len(vote)} classes, above the federation's fence "
                                 f"{fence:.3g} of the nodes' class counts")
        kept = {node: vote for node, vote in kept.items() if node not in refused}
    held = Counter(c for vote in kept.values() for c in set(vote))
    classes = sorted(held)
    if len(classes) > max_classes:
        ranked = sorted(classes, key=lambda c: -held[c])  # stable: sorted order among ties
        classes = sorted(ranked[:max_classes])
    return tuple(classes), refused


# ---------------------------------------------------------------------- data
def with_intercept(X: np.ndarray, scaling: float) -> np.ndarray:
    """``X`` with a constant column ``scaling`` appended (``X`` itself when 0)."""
    if not scaling:
        return X
    return np.hstack([X, np.full((X.shape[0], 1), float(scaling))])


def lift(X: np.ndarray, label_index: np.ndarray, num_classes: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """The one-vs-rest lifting of (X, labels): row i * K + k is e_k (x) x_i (x_i in block
    k of K), its label +1 if sample i is of class k, else -1. Returns float64
    ``(X_lift (nK, dK), y_lift (nK,))``."""
    n, d = X.shape
    K = int(num_classes)
    size = 8 * n * d * K * K
    if size > MAX_LIFTED_BYTES:
        raise ValueError(f"the one-vs-rest lifting of {n} samples x {d} features over {K} "
                         f"classes would take {size / 2 ** 30:.1f} GiB (at most "
                         f"{MAX_LIFTED_BYTES / 2 ** 30:.0f}): fewer classes (mocha.max-classes) "
                         "or fewer samples per device")
    lifted = np.zeros((n, K, K, d))
    ks = np.arange(K)
    lifted[:, ks, ks, :] = X[:, None, :]
    y = np.where(label_index[:, None] == ks[None, :], 1.0, -1.0)
    return lifted.reshape(n * K, K * d), y.reshape(n * K)


def predict_classes(X: np.ndarray, w: np.ndarray, num_classes: int) -> np.ndarray:
    """argmax_k w_k . x of each row of ``X`` (features as lifted, intercept column
    included), ``w`` the K blocks of a lifted model; the lowest index wins ties."""
    scores = X @ np.asarray(w).reshape(int(num_classes), X.shape[1]).T
    return np.argmax(scores, axis=1)


def multiclass_errors(X: np.ndarray, label_index: np.ndarray, w: np.ndarray,
                      num_classes: int) -> int:
    """Number of rows of ``X`` whose predicted class (:func:`predict_classes`) is not
    ``label_index``."""
    if X.shape[0] == 0:
        return 0
    return int(np.count_nonzero(predict_classes(X, w, num_classes) != label_index))
