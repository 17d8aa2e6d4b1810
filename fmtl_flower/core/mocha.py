"""MOCHA's server-side state and math, free of any Flower dependency.

The server keeps B = [b_1 .. b_m] (b_t = X_t^T alpha_t / n_t) and a task-relationship
formulation (:mod:`fmtl_flower.core.formulations`) with its inverse regulariser matrix
M = K^-1, and the models W = W(alpha) = B M (design decision 2: W is always the image of the
dual variables, recomputed after every Omega-step, so duality gaps are meaningful).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .decoupling import coupled_models, decoupled_inverse
from .formulations import Formulation, make_formulation, sigma_prime
from .objective import regulariser_value


def omega_step_due(server_round: int, omega_every: int, num_rounds: int | None) -> bool:
    """Whether an Omega-step follows the W-step of ``server_round``.

    Every ``omega_every`` rounds, but never after the last round: the final models are those
    the last W-steps optimised, not W(alpha) for a Sigma the dual variables never saw.
    """
    if omega_every <= 0 or server_round % omega_every != 0:
        return False
    return num_rounds is None or server_round < num_rounds


class ServerStateBasics:
    """What the dense and factored server states share: sizes from B, lambda from the
    formulation, the alpha = 0 start, and the updates of B and W (a state supplies how W
    follows a change of B, ``_add_to_models``, and how it takes the new M after an
    Omega-step, ``_take_inverse``)."""

    B: np.ndarray
    formulation: Formulation
    W: np.ndarray
    #: Tasks decoupled by robust mode (bool (m,), :mod:`fmtl_flower.core.decoupling`; None:
    #: none): the Omega-step learns nothing from their models.
    decoupled: np.ndarray | None = None

    def _check_B(self) -> None:
        if self.B.ndim != 2 or self.B.shape[1] != self.formulation.num_tasks:
            raise ValueError(f"B must be (d, {self.formulation.num_tasks}), got {self.B.shape}")

    def _add_to_models(self, tasks: np.ndarray, delta_B: np.ndarray) -> None:
        raise NotImplementedError

    def _take_inverse(self) -> None:
        raise NotImplementedError

    def recompute_models(self) -> None:
        raise NotImplementedError

    def add_updates(self, tasks: np.ndarray, delta_B: np.ndarray) -> None:
        """Add the dual-image changes of some tasks: b_t += delta_b_t, and W accordingly.

        Parameters
        ----------
        tasks : ndarray of shape (k,), int
            Distinct task indices.
        delta_B : ndarray of shape (d, k)
            Column j is the change of b_{tasks[j]}.
        """
        if len(tasks) == 0:
            return
        self.B[:, tasks] += delta_B
        self._add_to_models(tasks, delta_B)

    def reset_tasks(self, tasks: np.ndarray) -> None:
        """Set b_t = 0 (alpha_t = 0) for the given tasks and update W."""
        tasks = np.asarray(tasks, dtype=np.int64)
        if len(tasks):
            self.add_updates(tasks, -self.B[:, tasks].copy())
            self.B[:, tasks] = 0.0

    def omega_step(self) -> None:
        """Omega-step of the formulation for the current W, then W <- B M."""
        if self.formulation.fixed:
            return
        self.formulation.omega_step(coupled_models(self.W, self.decoupled))
        self._take_inverse()
        self.recompute_models()

    def regulariser(self) -> float:
        """(1/2) tr(W K W^T) of the current consistent pair."""
        return regulariser_value(self.W, self.B)

    @classmethod
    def zeros(cls, dim: int, formulation: Formulation):  # noqa: ANN206 - the subclass
        """alpha = 0 everywhere (B = 0, W = 0), Omega at the formulation's start."""
        return cls(B=np.zeros((dim, formulation.num_tasks)), formulation=formulation)

    @property
    def lam(self) -> float:
        return self.formulation.lam

    @property
    def num_tasks(self) -> int:
        return self.B.shape[1]

    @property
    def dim(self) -> int:
        return self.B.shape[0]


@dataclass
class MOCHAServerState(ServerStateBasics):
    """Server state of MOCHA for m tasks in d dimensions.

    Attributes
    ----------
    B : ndarray of shape (d, m)
        Accumulated dual images of the committed dual variables.
    formulation : Formulation
        The regulariser R(W) = (1/2) tr(W K W^T) (+ terms without W) and its Omega-step.
    M : ndarray of shape (m, m)
        K^-1 for the current Omega.
    W : ndarray of shape (d, m)
        Models W(alpha) = B M, kept in step with B and M.
    """

    B: np.ndarray
    formulation: Formulation
    M: np.ndarray = field(init=False)
    W: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._check_B()
        self._take_inverse()
        self.recompute_models()

    @classmethod
    def zeros_for(cls, dim: int, num_tasks: int, omega: str = "identity", *, lam: float,
                  **options) -> MOCHAServerState:
        """Shorthand: :meth:`zeros` with ``make_formulation(omega, num_tasks, lam=lam, ...)``."""
        return cls.zeros(dim, make_formulation(omega, num_tasks, lam=lam, **options))

    def m_diag(self) -> np.ndarray:
        """Diagonal of M = K^-1, one ``m_tt`` per task."""
        return np.diag(self.M).copy()

    def sigma_prime(self, mode: str = "global") -> np.ndarray:
        """Per-task sigma' for the current M (Lemma 9, Remark 5 or spectral)."""
        if self.decoupled is not None and self.decoupled.any():
            return sigma_prime(self.M, mode, self.formulation.gamma)
        return self.formulation.sigma_prime(mode)

    def decouple(self, decoupled: np.ndarray) -> None:
        """Decouple the tasks of the bool mask ``decoupled`` (m,) from the others (M -> M' of
        :func:`~fmtl_flower.core.decoupling.decoupled_inverse`, now and after every
        Omega-step), then W <- B M'."""
        self.decoupled = np.array(decoupled, dtype=bool)
        self._take_inverse()
        self.recompute_models()

    def recompute_models(self) -> None:
        """W <- B M."""
        self.W = self.B @ self.M

    def _add_to_models(self, tasks: np.ndarray, delta_B: np.ndarray) -> None:
        self.W += delta_B @ self.M[tasks, :]

    def _take_inverse(self) -> None:
        M = self.formulation.inverse_matrix()
        self.M = M if self.decoupled is None else decoupled_inverse(M, self.decoupled)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything needed to continue bit for bit: B, W, M and the formulation's arrays.

        W and M are stored, not recomputed, because W is updated incrementally
        (``W += delta_B M[tasks]``) and a recomputed ``B M`` differs in the last bits.
        """
        out = {"B": self.B, "W": self.W, "M": self.M}
        for key, value in formulation_arrays(self.formulation).items():
            out[f"formulation.{key}"] = value
        return out

    @classmethod
    def from_state_arrays(cls, arrays: dict[str, np.ndarray],
                          formulation: Formulation) -> MOCHAServerState:
        """Inverse of :meth:`state_arrays` for a freshly made ``formulation`` of the same kind
        and options (its arrays are overwritten); ValueError on any mismatch."""
        missing = {"B", "W", "M"} - set(arrays)
        if missing:
            raise ValueError(f"MOCHA state lacks {sorted(missing)}")
        fresh = formulation_arrays(formulation)
        saved = {k[len("formulation."):]: v for k, v in arrays.items()
                 if k.startswith("formulation.")}
        if set(saved) != set(fresh):
            raise ValueError(f"formulation state {sorted(saved)} does not match "
                             f"{type(formulation).__name__}'s {sorted(fresh)}")
        for key, value in saved.items():
            if value.shape != fresh[key].shape or value.dtype != fresh[key].dtype:
                raise ValueError(f"formulation array {key!r}: {value.dtype}{value.shape}, "
                                 f"expected {fresh[key].dtype}{fresh[key].shape}")
        B = np.array(arrays["B"], dtype=np.float64)
        m = formulation.num_tasks
        if B.ndim != 2 or B.shape[1] != m:
            raise ValueError(f"B must be (d, {m}), got {B.shape}")
        for key, shape in (("W", B.shape), ("M", (m, m))):
            if arrays[key].shape != shape:
                raise ValueError(f"{key} must be {shape}, got {arrays[key].shape}")
        for key, value in {**saved, "B": B, "W": arrays["W"], "M": arrays["M"]}.items():
            if not np.all(np.isfinite(value)):
                raise ValueError(f"state array {key!r} has non-finite values")
        set_formulation_arrays(formulation, saved)
        state = cls(B=B, formulation=formulation)
        state.M = np.array(arrays["M"], dtype=np.float64)
        state.W = np.array(arrays["W"], dtype=np.float64)
        return state


def formulation_arrays(formulation: Formulation) -> dict[str, np.ndarray]:
    """The formulation's array attributes (its Omega in whatever form it keeps it), for
    checkpoints; :func:`set_formulation_arrays` puts them back.

    A Cholesky factor kept as ``(array, lower)`` is stored as its array (``lower`` is fixed by
    the formulation's code).
    """
    out = {}
    for key, value in vars(formulation).items():
        if isinstance(value, np.ndarray):
            out[key] = value
        elif (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], np.ndarray)
              and isinstance(value[1], bool)):
            out[key] = value[0]
    return out


def set_formulation_arrays(formulation: Formulation, arrays: dict[str, np.ndarray]) -> None:
    """Overwrite a fresh formulation's arrays with saved ones; ValueError unless the keys,
    shapes and dtypes are the formulation's own and the values are finite."""
    fresh = formulation_arrays(formulation)
    if set(arrays) != set(fresh) or any(
            np.shape(arrays[k]) != fresh[k].shape or np.asarray(arrays[k]).dtype != fresh[k].dtype
            or not np.all(np.isfinite(arrays[k])) for k in arrays):
        raise ValueError(f"formulation state {sorted(arrays)} does not match "
                         f"{type(formulation).__name__}'s {sorted(fresh)}")
    for key, value in arrays.items():
        current = getattr(formulation, key)
        value = np.array(value)
        if isinstance(current, tuple):
            setattr(formulation, key, (value, current[1]))
        else:
            setattr(formulation, key, value)
