"""The model backend interface behind FedEM and its baselines.

FedEM's numerics (:mod:`fmtl_flower.core.fedem`) never look inside a model: they ask a
*backend* for per-sample losses, class probabilities and a responsibility-weighted SGD step,
and treat the parameters as an opaque flat float64 vector (what is aggregated and sent). Two
backends implement it:

* the numpy models of :mod:`fmtl_flower.core.models` (logistic, softmax, MLP);
* :class:`fmtl_flower.core.torch_backend.TorchBackend`, any ``torch.nn.Module`` producing
  logits (imported only when used: torch is an optional extra).

The flat vector of a backend is the concatenation, in a fixed order, of named arrays
(:meth:`ModelBackend.param_arrays`): for a torch module its ``state_dict`` (weights and
buffers such as BatchNorm's running statistics, each in its own dtype, stored exactly in
float64); for a numpy model one array ``params``. The named arrays are what becomes a Flower
``ArrayRecord`` (the conversion lives above core); :func:`layout_signature` names the layout
so that both ends of a federation can check they agree on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from .local_sgd import SGDConfig

__all__ = ["LayoutEntry", "ModelBackend", "check_flat_params", "flatten_arrays", "layout_of",
           "layout_signature", "unflatten_arrays"]

#: One named array of a parameter layout: (name, shape, numpy dtype name).
LayoutEntry = tuple[str, tuple[int, ...], str]


@runtime_checkable
class ModelBackend(Protocol):
    """What FedEM needs of a model family (parameters: flat float64 vectors of ``num_params``).

    Attributes
    ----------
    name : str
        ``"logistic"``, ``"softmax"``, ``"mlp"`` or ``"torch"``.
    num_params : int
        Length P of the flat parameter vector.
    """

    name: str
    num_params: int

    def check_params(self, params) -> np.ndarray:
        """``params`` as a finite float64 (P,) array (ValueError otherwise)."""
        ...

    def per_sample_loss(self, params: np.ndarray, X, y) -> np.ndarray:
        """-log p(y_i | x_i; params) of every sample, float64 (n,)."""
        ...

    def predict_proba(self, params: np.ndarray, X) -> np.ndarray:
        """Class probabilities (n, C), float64, rows on the simplex."""
        ...

    def sgd_epochs(self, params: np.ndarray, momentum_buf: np.ndarray, X, y,
                   sample_weight: np.ndarray, config: SGDConfig, rng: np.random.Generator,
                   anchor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """Epochs of weighted mini-batch SGD with momentum (torch's rule) on
        (1/|batch|) sum_i w_i l_i, batches in the order ``rng.permutation(n)`` per epoch.

        Returns the new parameters, the new momentum buffer (the per-component optimiser
        state, a (P,) float64 vector) and the mean weighted batch loss; the inputs are not
        modified. See :func:`fmtl_flower.core.local_sgd.sgd_epochs` for the exact rule.
        """
        ...

    def param_arrays(self, params: np.ndarray) -> dict[str, np.ndarray]:
        """The named arrays (in their own shapes and dtypes) that ``params`` flattens."""
        ...

    def layout(self) -> list[LayoutEntry]:
        """(name, shape, dtype) of every named array, in flattening order."""
        ...


def check_flat_params(params, num_params: int, owner: object) -> np.ndarray:
    """``params`` as a finite float64 (num_params,) array, no copy when it already is one
    (every backend's ``check_params``; ``owner`` names the model in the messages).

    Raises
    ------
    ValueError
        Not numeric, not 1-D, wrong length or not finite.
    """
    try:
        out = np.asarray(params, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"params is not a real numeric array: {err}") from None
    if out.ndim != 1 or out.size != num_params:
        raise ValueError(f"params must have shape ({num_params},) for {owner!r}, "
                         f"got shape {out.shape}")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"params has {np.count_nonzero(~np.isfinite(out))} non-finite "
                         "entries")
    return out


def layout_of(arrays: Mapping[str, np.ndarray]) -> list[LayoutEntry]:
    """The layout (name, shape, dtype name) of named arrays, in their order."""
    return [(str(k), tuple(int(s) for s in np.shape(v)), str(np.asarray(v).dtype))
            for k, v in arrays.items()]


def layout_signature(layout: Sequence[LayoutEntry]) -> str:
    """A short stable name of a layout (16 hex digits of a SHA-256 of names, shapes, dtypes)."""
    text = ";".join(f"{k}:{'x'.join(map(str, s))}:{d}" for k, s, d in layout)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flatten_arrays(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """Named arrays as one float64 vector (each raveled in C order, in mapping order).

    Exact for float16/32/64 and for integers below 2**53.
    """
    parts = [np.asarray(v).reshape(-1).astype(np.float64) for v in arrays.values()]
    return np.concatenate(parts) if parts else np.zeros(0)


def unflatten_arrays(flat: np.ndarray, layout: Sequence[LayoutEntry]) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten_arrays`: integer entries are rounded to the nearest integer
    (an averaged counter such as BatchNorm's ``num_batches_tracked``)."""
    flat = np.asarray(flat, dtype=np.float64)
    total = sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in layout)
    if flat.ndim != 1 or flat.size != total:
        raise ValueError(f"flat parameters must have shape ({total},), got {flat.shape}")
    out: dict[str, np.ndarray] = {}
    start = 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        chunk = flat[start:start + size].reshape(shape)
        kind = np.dtype(dtype)
        if np.issubdtype(kind, np.integer) or kind == np.bool_:
            chunk = np.rint(chunk)
        out[name] = np.array(chunk, dtype=kind)  # 0-d stays an array
        start += size
    return out
