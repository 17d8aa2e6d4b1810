"""Small numpy models for FedEM and its baselines: logistic, softmax and one-hidden-layer MLP.

A model is a stateless description of a parametric family; its parameters live in one flat
float64 vector (what is sent over the network and what the local solver updates). Every
method is vectorised over the batch (matrix products, no loop over samples) and works in
float64.

Losses are negative log-likelihoods, computed stably (softplus for the logistic model,
log-sum-exp for the softmax output), so they are finite, and raise no floating-point warning,
whenever the logits are finite (e.g. logits of size 1e4).

Layouts of the flat parameter vector (row-major):

* ``logistic`` (binary, labels in {0, 1}): ``[w (d), b]``, logit z = x^T w + b, loss
  BCE-with-logits;
* ``softmax`` (C classes, labels 0..C-1): ``[W (d x C), b (C)]``, logits x^T W + b;
* ``mlp`` (C >= 2 classes): ``[W1 (d x h), b1 (h), W2 (h x C), b2 (C)]``, logits
  relu(x^T W1 + b1)^T W2 + b2 (the ReLU's derivative at 0 is taken as 0, as in torch).

Initialisation follows torch's ``nn.Linear``: every weight and bias of a layer with ``fan_in``
inputs is drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), layer by layer, weights first.

Every model implements :class:`fmtl_flower.core.backend.ModelBackend` (FedEM's model
interface; :class:`fmtl_flower.core.torch_backend.TorchBackend` is the other implementation):
its named arrays are one array ``params``, the flat vector itself.
"""

from __future__ import annotations

import operator

import numpy as np

from .backend import check_flat_params
from .special import expit  # numpy: a device needs no scipy

__all__ = ["MODELS", "LogisticModel", "MLPModel", "Model", "SoftmaxModel", "make_model"]

MODELS = ("logistic", "softmax", "mlp")


def _positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return out


def _log_softmax(Z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of (n, C) logits (max-shifted: exp never overflows)."""
    shifted = Z - Z.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


class Model:
    """Base class: a parametric family of conditional distributions p(y | x; params).

    Attributes
    ----------
    name : str
        One of :data:`MODELS`.
    dim : int
        Number of features d (columns of X).
    num_classes : int
        Number of classes C (2 for the logistic model).
    num_params : int
        Length of the flat parameter vector.
    """

    name: str
    dim: int
    num_classes: int
    num_params: int

    def __init__(self, dim: int, num_classes: int) -> None:
        self.dim = _positive_int(dim, "dim")
        self.num_classes = _positive_int(num_classes, "num_classes", 2)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dim={self.dim}, num_classes={self.num_classes}, "
                f"num_params={self.num_params})")

    # -- public API (validates its inputs) -------------------------------------------------
    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """Fresh parameters, torch-``nn.Linear``-like: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

        Parameters
        ----------
        rng : numpy Generator

        Returns
        -------
        ndarray of shape (num_params,), float64
        """
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy Generator, got {type(rng).__name__}")
        parts = []
        for fan_in, fan_out in self._layers():
            bound = 1.0 / np.sqrt(fan_in)
            parts.append(rng.uniform(-bound, bound, size=fan_in * fan_out))
            parts.append(rng.uniform(-bound, bound, size=fan_out))
        return np.concatenate(parts)

    def check_params(self, params) -> np.ndarray:
        """``params`` as a float64 1-D array of length ``num_params`` with finite entries.

        Used on arrays received from the network. No copy when ``params`` already is one.

        Raises
        ------
        ValueError
            Not numeric, not 1-D, wrong length or not finite.
        """
        return check_flat_params(params, self.num_params, self)

    def check_X(self, X) -> np.ndarray:
        """``X`` as a float64 (n, dim) array (ValueError if not 2-D with ``dim`` columns)."""
        try:
            out = np.asarray(X, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"X is not a real numeric array: {err}") from None
        if out.ndim != 2 or out.shape[1] != self.dim:
            raise ValueError(f"X must have shape (n, {self.dim}), got shape {out.shape}")
        return out

    def check_y(self, y, n: int) -> np.ndarray:
        """Labels as this model uses them internally (ValueError naming the bad values).

        Integers (or floats with integer values) in 0..C-1; returned as int64 class indices
        (float64 0/1 for the logistic model).
        """
        arr = np.asarray(y)
        if arr.ndim != 1 or arr.shape[0] != n:
            raise ValueError(f"y must have shape ({n},), got shape {arr.shape}")
        if arr.dtype == np.bool_:
            arr = arr.astype(np.int64)
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise ValueError(f"y must hold integer class labels, got dtype {arr.dtype}")
        if np.issubdtype(arr.dtype, np.floating):
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(arr) | (arr != np.round(arr))
            if np.any(bad):
                raise ValueError(f"y has non-integer labels: {np.unique(arr[bad])[:5].tolist()}")
        bad = (arr < 0) | (arr >= self.num_classes)
        if np.any(bad):
            raise ValueError(f"y has labels outside 0..{self.num_classes - 1}: "
                             f"{np.unique(arr[bad])[:5].tolist()}")
        return arr.astype(np.int64)

    @staticmethod
    def check_weights(sample_weight, n: int) -> np.ndarray:
        """``sample_weight`` as a float64 (n,) array of finite, nonnegative weights."""
        try:
            w = np.asarray(sample_weight, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"sample_weight is not a real numeric array: {err}") from None
        if w.ndim != 1 or w.shape[0] != n:
            raise ValueError(f"sample_weight must have shape ({n},), got shape {w.shape}")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError("sample_weight must be finite and nonnegative")
        return w

    def per_sample_loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Negative log-likelihood -log p(y_i | x_i; params) of every sample.

        Parameters
        ----------
        params : ndarray of shape (num_params,)
        X : ndarray of shape (n, dim)
        y : ndarray of shape (n,)
            Class labels 0..C-1.

        Returns
        -------
        ndarray of shape (n,), float64
        """
        params = self.check_params(params)
        X = self.check_X(X)
        return self._per_sample_loss(params, X, self.check_y(y, X.shape[0]))

    def predict_proba(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class probabilities p(c | x_i; params), shape (n, num_classes); rows sum to 1.

        For the logistic model the columns are [1 - p, p] with p = sigmoid(logit).
        """
        return self._predict_proba(self.check_params(params), self.check_X(X))

    def loss_grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                  sample_weight: np.ndarray) -> tuple[float, np.ndarray]:
        """Weighted loss and its gradient, **summed** over the batch (not divided by n).

        Parameters
        ----------
        params : ndarray of shape (num_params,)
        X : ndarray of shape (n, dim)
        y : ndarray of shape (n,)
        sample_weight : ndarray of shape (n,)
            Nonnegative weights w_i.

        Returns
        -------
        loss : float
            sum_i w_i l_i.
        grad : ndarray of shape (num_params,)
            sum_i w_i grad l_i, in the layout of ``params``.
        """
        params = self.check_params(params)
        X = self.check_X(X)
        n = X.shape[0]
        return self._loss_grad(params, X, self.check_y(y, n), self.check_weights(sample_weight, n))

    def sgd_epochs(self, params: np.ndarray, momentum_buf: np.ndarray, X: np.ndarray,
                   y: np.ndarray, sample_weight: np.ndarray, config, rng: np.random.Generator,
                   anchor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """Weighted local SGD with momentum: :func:`fmtl_flower.core.local_sgd.sgd_epochs`."""
        from .local_sgd import sgd_epochs

        return sgd_epochs(self, params, momentum_buf, X, y, sample_weight, config, rng, anchor)

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """One named array, ``params`` (num_params,) float64."""
        return [("params", (self.num_params,), "float64")]

    def param_arrays(self, params: np.ndarray) -> dict[str, np.ndarray]:
        """``{"params": params}`` (checked)."""
        return {"params": self.check_params(params)}

    # -- to implement (inputs already validated) -------------------------------------------
    def _layers(self) -> list[tuple[int, int]]:
        """(fan_in, fan_out) of every linear layer, in parameter order."""
        raise NotImplementedError

    def _per_sample_loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _predict_proba(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _loss_grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                   w: np.ndarray) -> tuple[float, np.ndarray]:
        raise NotImplementedError


class LogisticModel(Model):
    """Binary logistic regression: params ``[w (d), b]``, loss BCE-with-logits."""

    name = "logistic"

    def __init__(self, dim: int, num_classes: int = 2) -> None:
        if num_classes != 2:
            raise ValueError(f"num_classes must be 2 for the logistic model, got {num_classes}")
        super().__init__(dim, 2)
        self.num_params = self.dim + 1

    def _layers(self) -> list[tuple[int, int]]:
        return [(self.dim, 1)]

    def check_y(self, y, n: int) -> np.ndarray:
        """Labels in {0, 1} (ints, bools or integer-valued floats) as float64."""
        return super().check_y(y, n).astype(np.float64)

    def _logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        return X @ params[:-1] + params[-1]

    def _per_sample_loss(self, params, X, y):
        # -log sigmoid(+-z) = softplus(-+z): with s = 1 - 2y the loss is softplus(s z), exact
        # for either label (no cancellation as in softplus(z) - y z)
        return np.logaddexp(0.0, (1.0 - 2.0 * y) * self._logits(params, X))

    def _predict_proba(self, params, X):
        z = self._logits(params, X)
        return np.stack([expit(-z), expit(z)], axis=1)

    def _loss_grad(self, params, X, y, w):
        z = self._logits(params, X)
        loss = float(w @ np.logaddexp(0.0, (1.0 - 2.0 * y) * z))
        r = w * (expit(z) - y)  # d(w_i l_i) / d z_i
        grad = np.empty(self.num_params)
        grad[:-1] = r @ X
        grad[-1] = r.sum()
        return loss, grad


class _SoftmaxOutput(Model):
    """Shared softmax-output pieces: weighted cross-entropy and its logit gradient."""

    def _cross_entropy(self, Z: np.ndarray, y: np.ndarray, w: np.ndarray
                       ) -> tuple[float, np.ndarray]:
        """(sum_i w_i l_i, G) with G[i] = w_i (softmax(Z_i) - onehot(y_i)), G of shape (n, C)."""
        logp = _log_softmax(Z)
        rows = np.arange(Z.shape[0])
        loss = -float(w @ logp[rows, y])
        G = np.exp(logp)
        G[rows, y] -= 1.0
        G *= w[:, None]
        return loss, G

    def _per_sample_loss(self, params, X, y):
        return -_log_softmax(self._logits(params, X))[np.arange(X.shape[0]), y]

    def _predict_proba(self, params, X):
        return np.exp(_log_softmax(self._logits(params, X)))

    def _logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class SoftmaxModel(_SoftmaxOutput):
    """Multinomial logistic regression: params ``[W (d x C), b (C)]``, logits x^T W + b."""

    name = "softmax"

    def __init__(self, dim: int, num_classes: int = 2) -> None:
        super().__init__(dim, num_classes)
        self.num_params = (self.dim + 1) * self.num_classes

    def _layers(self) -> list[tuple[int, int]]:
        return [(self.dim, self.num_classes)]

    def _unpack(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d, C = self.dim, self.num_classes
        return params[:d * C].reshape(d, C), params[d * C:]

    def _logits(self, params, X):
        W, b = self._unpack(params)
        return X @ W + b

    def _loss_grad(self, params, X, y, w):
        loss, G = self._cross_entropy(self._logits(params, X), y, w)
        grad = np.empty(self.num_params)
        gW, gb = self._unpack(grad)
        np.matmul(X.T, G, out=gW)
        G.sum(axis=0, out=gb)
        return loss, grad


class MLPModel(_SoftmaxOutput):
    """One hidden layer of ReLU units, softmax output.

    Params ``[W1 (d x h), b1 (h), W2 (h x C), b2 (C)]``; logits relu(x^T W1 + b1)^T W2 + b2.
    """

    name = "mlp"

    def __init__(self, dim: int, num_classes: int = 2, hidden: int = 32) -> None:
        super().__init__(dim, num_classes)
        self.hidden = _positive_int(hidden, "hidden")
        d, h, C = self.dim, self.hidden, self.num_classes
        self.num_params = d * h + h + h * C + C

    def __repr__(self) -> str:
        return (f"MLPModel(dim={self.dim}, num_classes={self.num_classes}, hidden={self.hidden}, "
                f"num_params={self.num_params})")

    def _layers(self) -> list[tuple[int, int]]:
        return [(self.dim, self.hidden), (self.hidden, self.num_classes)]

    def _unpack(self, params: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        d, h, C = self.dim, self.hidden, self.num_classes
        a, b, c = d * h, d * h + h, d * h + h + h * C
        return params[:a].reshape(d, h), params[a:b], params[b:c].reshape(h, C), params[c:]

    def _logits(self, params, X):
        W1, b1, W2, b2 = self._unpack(params)
        return np.maximum(X @ W1 + b1, 0.0) @ W2 + b2

    def _loss_grad(self, params, X, y, w):
        W1, b1, W2, b2 = self._unpack(params)
        H = X @ W1 + b1
        np.maximum(H, 0.0, out=H)
        loss, G = self._cross_entropy(H @ W2 + b2, y, w)
        grad = np.empty(self.num_params)
        gW1, gb1, gW2, gb2 = self._unpack(grad)
        np.matmul(H.T, G, out=gW2)
        G.sum(axis=0, out=gb2)
        dH = G @ W2.T
        dH[H <= 0.0] = 0.0  # relu'(0) = 0, as in torch
        np.matmul(X.T, dH, out=gW1)
        dH.sum(axis=0, out=gb1)
        return loss, grad


def make_model(name: str, dim: int, num_classes: int = 2, hidden: int = 32) -> Model:
    """The model family ``name`` (one of :data:`MODELS`) for ``dim`` features.

    Parameters
    ----------
    name : {"logistic", "softmax", "mlp"}
    dim : int
        Number of features, >= 1.
    num_classes : int
        Number of classes, >= 2 (exactly 2 for ``logistic``).
    hidden : int
        Hidden units of ``mlp`` (ignored by the other models), >= 1.
    """
    if name == "logistic":
        return LogisticModel(dim, num_classes)
    if name == "softmax":
        return SoftmaxModel(dim, num_classes)
    if name == "mlp":
        return MLPModel(dim, num_classes, hidden)
    raise ValueError(f"unknown model name {name!r}; expected one of {MODELS}")
