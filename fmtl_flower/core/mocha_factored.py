"""MOCHA's server state with M = K^-1 in factored form, and the choice dense/factored.

:class:`FactoredMOCHAServerState` has the public interface of
:class:`fmtl_flower.core.mocha.MOCHAServerState` (``B``, ``W``, ``formulation``, ``m_diag()``,
``sigma_prime(mode)``, ``add_updates``, ``reset_tasks``, ``omega_step``, ``regulariser``,
``state_arrays`` / ``from_state_arrays``) and the same values to rounding, but keeps
M = V diag(s) V^T + c I (:class:`fmtl_flower.core.factored.FactoredMatrix`) instead of an
m x m array, so its memory is O(m d) and its costs are

* W = B M and ``add_updates`` for k tasks: O(m d r) (dense: O(m^2 d) and O(k m d));
* the Omega-step: O(m d^2) (dense: O(m^3));
* ``m_diag()``: O(m r) once per Omega-step, then cached;
* ``sigma_prime("spectral")``: a few O(m r^2) steps once per Omega-step, then cached;
  ``"global"`` / ``"per-task"``: O(m^2 r / 2) flops in tiles once per Omega-step, then
  cached (the dense state recomputes sigma' whenever it is asked).

:func:`choose_server_path` decides between the two, :func:`make_server_state` builds either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .decoupling import coupling_weights, decoupled_factor
from .factored import (
    DENSE_MATERIALISE_MAX_TASKS,
    FactoredFormulation,
    FactoredMatrix,
    _factor_arrays,
    _factor_from_arrays,
    make_factored_formulation,
    sigma_prime_factored,
)
from .formulations import FORMULATIONS, SIGMA_MODES, make_formulation
from .mocha import MOCHAServerState, ServerStateBasics

__all__ = [
    "FACTORED_MIN_TASKS",
    "GRAPHICAL_MAX_TASKS",
    "SERVER_PATHS",
    "FactoredMOCHAServerState",
    "choose_server_path",
    "make_server_state",
    "restore_server_state",
]

#: ``auto`` keeps the dense path (bit-identical to earlier releases) up to this many tasks.
FACTORED_MIN_TASKS = 1000
#: ``graphical`` is dense only; its Omega-step (graphical lasso) costs O(m^3) per iteration
#: (an m x m eigh, seconds at m = 2000) and hundreds of iterations.
GRAPHICAL_MAX_TASKS = 2000
SERVER_PATHS = ("auto", "dense", "factored")


def choose_server_path(num_tasks: int, dim: int | None, omega: str,
                       path: str = "auto") -> str | None:
    """``"dense"`` or ``"factored"`` for m = ``num_tasks`` models of dimension d = ``dim``.

    ``auto``: factored when m > ``FACTORED_MIN_TASKS`` and m > 2 d (W^T W has rank
    <= d < m / 2), or when m > ``DENSE_MATERIALISE_MAX_TASKS`` (the dense m x m matrices
    would not fit); dense otherwise. ``graphical`` is always dense. ``dim=None`` (d not
    known yet): the same checks, and None when the answer depends on d.

    Raises
    ------
    ValueError
        Unknown ``path`` or ``omega``; ``graphical`` with ``path="factored"`` or with more
        than ``GRAPHICAL_MAX_TASKS`` tasks; ``path="dense"`` with more than
        ``DENSE_MATERIALISE_MAX_TASKS`` tasks.
    """
    if path not in SERVER_PATHS:
        raise ValueError(f"path must be one of {SERVER_PATHS}, got {path!r}")
    if omega not in FORMULATIONS:
        raise ValueError(f"omega must be one of {tuple(FORMULATIONS)}, got {omega!r}")
    m, d = int(num_tasks), None if dim is None else int(dim)
    if m < 1 or (d is not None and d < 1):
        raise ValueError(f"num_tasks and dim must be >= 1, got {num_tasks}, {dim}")
    if omega == "graphical":
        if path == "factored":
            raise ValueError(
                "omega 'graphical' has no factored form (the graphical lasso "
                "gives a dense Omega); use path 'dense' or 'auto'"
            )
        if m > GRAPHICAL_MAX_TASKS:
            raise ValueError(
                f"omega 'graphical' is supported up to {GRAPHICAL_MAX_TASKS} tasks "
                f"(its Omega-step costs O(m^3) per iteration), got {m}; use "
                "'probabilistic', 'clustered', 'mean' or 'identity'"
            )
        return "dense"
    if path == "dense":
        if m > DENSE_MATERIALISE_MAX_TASKS:
            raise ValueError(
                f"path 'dense' forms m x m matrices; supported up to "
                f"{DENSE_MATERIALISE_MAX_TASKS} tasks, got {m}: use 'factored'"
            )
        return "dense"
    if path == "factored":
        return "factored"
    if m > DENSE_MATERIALISE_MAX_TASKS:
        return "factored"
    if m > FACTORED_MIN_TASKS:
        return None if d is None else ("factored" if m > 2 * d else "dense")
    return "dense"


@dataclass
class FactoredMOCHAServerState(ServerStateBasics):
    """Server state of MOCHA for m tasks in d dimensions, M = K^-1 factored.

    The attributes of :class:`fmtl_flower.core.mocha.MOCHAServerState` (``B``,
    ``formulation``, ``M``, ``W = B M``), with ``formulation`` a
    :class:`~fmtl_flower.core.factored.FactoredFormulation` and ``M`` a
    :class:`~fmtl_flower.core.factored.FactoredMatrix`.
    """

    B: np.ndarray
    formulation: FactoredFormulation
    M: FactoredMatrix = field(init=False)
    W: np.ndarray = field(init=False)
    _m_diag: np.ndarray | None = field(init=False, default=None, repr=False)
    _sigma: dict[str, np.ndarray] = field(init=False, default_factory=dict, repr=False)
    _coupling: np.ndarray | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.formulation, FactoredFormulation):
            raise ValueError(
                "formulation must be a FactoredFormulation (make_factored_formulation)"
            )
        self._check_B()
        self._take_inverse()
        self.recompute_models()

    @classmethod
    def zeros_for(
        cls, dim: int, num_tasks: int, omega: str = "identity", *, lam: float, **options: Any
    ) -> FactoredMOCHAServerState:
        """:meth:`zeros` with ``make_factored_formulation(omega, num_tasks, lam=lam, ...)``."""
        return cls.zeros(dim, make_factored_formulation(omega, num_tasks, lam=lam, **options))

    def _set_M(self, M: FactoredMatrix) -> None:
        self.M = M
        self._m_diag = None
        self._sigma = {}
        self._coupling = None

    def decouple(self, decoupled: np.ndarray) -> None:
        """Decouple the tasks of the bool mask ``decoupled`` (m,) from the others (M -> M' of
        :func:`~fmtl_flower.core.decoupling.decoupled_factor`, now and after every
        Omega-step), then W <- B M': the dense state's
        :meth:`~fmtl_flower.core.mocha.MOCHAServerState.decouple`, in factored form."""
        self.decoupled = np.array(decoupled, dtype=bool)
        self._take_inverse()
        self.recompute_models()

    def coupling_weights(self) -> np.ndarray:
        """:func:`~fmtl_flower.core.decoupling.coupling_weights` of the current M (cached
        until M changes: O(m^2 r / 2) flops in tiles)."""
        if self._coupling is None:
            self._coupling = coupling_weights(self.M)
        return self._coupling.copy()

    def m_diag(self) -> np.ndarray:
        """Diagonal of M = K^-1, one ``m_tt`` per task (cached until the next Omega-step)."""
        if self._m_diag is None:
            self._m_diag = self.M.diag()
        return self._m_diag.copy()

    def sigma_prime(self, mode: str = "global") -> np.ndarray:
        """Per-task sigma' for the current M (cached per mode until the next Omega-step).

        See :func:`fmtl_flower.core.factored.sigma_prime_factored` for the costs: call it
        right after :meth:`omega_step` if the round's latency matters.
        """
        if mode not in SIGMA_MODES:
            raise ValueError(f"unknown sigma-mode {mode!r}; expected one of {SIGMA_MODES}")
        if mode not in self._sigma:
            self._sigma[mode] = sigma_prime_factored(self.M, mode, self.formulation.gamma)
        return self._sigma[mode].copy()

    def recompute_models(self) -> None:
        """W <- B M."""
        self.W = self.M.right_multiply(self.B)

    def _add_to_models(self, tasks: np.ndarray, delta_B: np.ndarray) -> None:
        self.M.add_rows_product(self.W, delta_B, tasks)

    def _take_inverse(self) -> None:
        M = self.formulation.inverse_factor()
        self._set_M(M if self.decoupled is None else decoupled_factor(M, self.decoupled))

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything needed to continue bit for bit: B, W, M's factor and the formulation's.

        Keys ``B``, ``W``, ``M.V``, ``M.s``, ``M.c`` and ``formulation.*``; r (M.V's column
        count) varies between Omega-steps. W and M are stored, not recomputed (W is
        updated incrementally, so a recomputed B M differs in the last bits).
        """
        out = {"B": self.B, "W": self.W, **_factor_arrays("M", self.M)}
        for key, value in self.formulation.state_arrays().items():
            out[f"formulation.{key}"] = value
        return out

    @classmethod
    def from_state_arrays(
        cls, arrays: dict[str, np.ndarray], formulation: FactoredFormulation
    ) -> FactoredMOCHAServerState:
        """Inverse of :meth:`state_arrays` for a freshly made ``formulation`` of the same kind
        and options (its Omega is overwritten); ValueError on any mismatch."""
        missing = {"B", "W", "M.V", "M.s", "M.c"} - set(arrays)
        if missing:
            raise ValueError(f"factored MOCHA state lacks {sorted(missing)}")
        m = formulation.num_tasks
        B = np.array(arrays["B"], dtype=np.float64)
        if B.ndim != 2 or B.shape[1] != m:
            raise ValueError(f"B must be (d, {m}), got {B.shape}")
        W = np.array(arrays["W"], dtype=np.float64)
        if W.shape != B.shape:
            raise ValueError(f"W must be {B.shape}, got {W.shape}")
        if not (np.all(np.isfinite(B)) and np.all(np.isfinite(W))):
            raise ValueError("state arrays 'B' / 'W' have non-finite values")
        M = _factor_from_arrays("M", {k: v for k, v in arrays.items() if k.startswith("M.")}, m)
        formulation.load_state_arrays(
            {k[len("formulation.") :]: v for k, v in arrays.items() if k.startswith("formulation.")}
        )
        state = cls(B=B, formulation=formulation)
        state._set_M(M)
        state.W = W
        return state


def make_server_state(
    dim: int,
    num_tasks: int,
    omega: str = "probabilistic",
    *,
    lam: float,
    path: str = "auto",
    **options: Any,
) -> MOCHAServerState | FactoredMOCHAServerState:
    """MOCHA's server state at alpha = 0 on the path :func:`choose_server_path` picks.

    Parameters
    ----------
    dim, num_tasks : int
        d and m.
    omega : str
        A formulation name (``fmtl_flower.core.formulations.FORMULATIONS``).
    lam : float
        lambda.
    path : {"auto", "dense", "factored"}
    **options
        ``make_formulation``'s other keyword arguments (lam2, s2, eta, k, eps_rel, gamma).
    """
    chosen = choose_server_path(num_tasks, dim, omega, path)
    if chosen == "dense":
        return MOCHAServerState.zeros(dim, make_formulation(omega, num_tasks, lam=lam, **options))
    return FactoredMOCHAServerState.zeros(
        dim, make_factored_formulation(omega, num_tasks, lam=lam, **options)
    )


def restore_server_state(
    arrays: dict[str, np.ndarray], num_tasks: int, omega: str, *, lam: float, **options: Any
) -> MOCHAServerState | FactoredMOCHAServerState:
    """Inverse of either state's ``state_arrays()``: the path is read from the keys
    (``M`` dense, ``M.V`` factored); the formulation is rebuilt from the options."""
    if "M.V" in arrays:
        formulation = make_factored_formulation(omega, num_tasks, lam=lam, **options)
        return FactoredMOCHAServerState.from_state_arrays(arrays, formulation)
    return MOCHAServerState.from_state_arrays(
        arrays, make_formulation(omega, num_tasks, lam=lam, **options)
    )
