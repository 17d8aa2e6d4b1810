"""``NumPyClient`` devices for MOCHA and FedEM, for projects written with ``client_fn``.

Most Flower projects build their ClientApp as ``ClientApp(client_fn=...)`` around a
``NumPyClient``. :class:`MOCHANumPyClient` and :class:`FedEMNumPyClient` fit that shape::

    from flwr.client import ClientApp

    from fmtl_flower import MOCHANumPyClient

    def client_fn(context):
        X, y, X_test, y_test = load_my_partition(context.node_config["partition-id"])
        return MOCHANumPyClient(context, X, y, X_test, y_test).to_client()

    app = ClientApp(client_fn=client_fn)

``get_properties`` answers the server's discovery, ``fit`` and ``evaluate`` run the *same*
handlers as the native ClientApps (:class:`~fmtl_flower.clients.mocha.MOCHAClient`,
:class:`~fmtl_flower.clients.fedem.FedEMClient`) on the native message that the legacy one
stands for (:mod:`fmtl_flower.legacy`), so a federation of NumPyClient devices computes
exactly what a native one does. The device state lives in ``context.state`` under the same
records and the same dual commit protocol (MOCHA) or resume slots (FedEM);
``get_parameters`` returns the model arrays the device received last (MOCHA: ``[w_t]``;
FedEM: ``[components]``), kept in the record ``numpyclient.arrays``.

The server side talks to such devices through :class:`~fmtl_flower.legacy.LegacyGrid`:
``strategy.start(grid=LegacyGrid(grid), ...)`` (``client_api="auto"`` also serves native
devices in the same federation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType
from flwr.client import NumPyClient

from ..legacy import WHOAMI, legacy_result, native_instruction
from ..wire import from_array

if TYPE_CHECKING:  # each family's handlers load on first use (a MOCHA device loads no FedEM)
    from .fedem import FedEMClient
    from .mocha import MOCHAClient

__all__ = ["FedEMNumPyClient", "MOCHANumPyClient"]

#: ``context.state`` record of the model arrays received last (for ``get_parameters``).
STATE_RECEIVED = "numpyclient.arrays"


class _NativeBackedNumPyClient(NumPyClient):
    """A NumPyClient running a native fmtl-flower client's handlers."""

    #: The native metric ``evaluate`` returns as its loss.
    loss_metric = ""

    def __init__(self, context: Context, X: np.ndarray, y: np.ndarray,
                 X_test: np.ndarray | None = None, y_test: np.ndarray | None = None, *,
                 state_dir: str | None = None) -> None:
        if (X_test is None) != (y_test is None):
            raise ValueError("give both X_test and y_test, or neither")
        data = (X, y) if X_test is None else (X, y, X_test, y_test)
        self.context = context
        self.native = self._native_client(lambda _context: data, state_dir)

    @staticmethod
    def _native_client(load_data: Any, state_dir: str | None) -> Any:
        raise NotImplementedError

    def _call(self, message_type: str, parameters: list[np.ndarray],
              config: dict[str, Any]) -> Message:
        handler = {WHOAMI: self.native.whoami, MessageType.TRAIN: self.native.train,
                   MessageType.EVALUATE: self.native.evaluate}[message_type]
        message = native_instruction(message_type, parameters, config, self.context)
        reply = handler(message, self.context)
        if message_type != WHOAMI and "arrays" in message.content:
            self.context.state[STATE_RECEIVED] = message.content["arrays"]
        return reply

    # -- NumPyClient ------------------------------------------------------------------------
    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """The device's ``whoami`` answer (task id and sizes) when the server asks for it."""
        if config.get("fmtl.query") != "whoami":
            return {}
        reply = self._call(WHOAMI, [], config)
        return dict(reply.content["info"])

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        """The model arrays this device received last ([] before its first round)."""
        if STATE_RECEIVED not in self.context.state:
            return []
        record: ArrayRecord = self.context.state[STATE_RECEIVED]
        return [np.array(from_array(record[k])) for k in record.keys()]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        """One round of local training (the native ``train`` handler)."""
        arrays, metrics = legacy_result(self._call(MessageType.TRAIN, parameters, config))
        return arrays, int(metrics.get("n-train", 0)), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]
                 ) -> tuple[float, int, dict[str, Any]]:
        """Metrics at the received model (the native ``evaluate`` handler)."""
        _, metrics = legacy_result(self._call(MessageType.EVALUATE, parameters, config))
        count = metrics.get("test-n", metrics.get("n-train", 0))
        return float(metrics.get(self.loss_metric, 0.0)), int(count), metrics


class MOCHANumPyClient(_NativeBackedNumPyClient):
    """A MOCHA device as a ``NumPyClient``.

    Parameters
    ----------
    context : Context
        The node's context (``client_fn``'s argument): the task id comes from its node config
        (``task-id``, else ``partition-id``) and the dual variables live in its ``state``.
    X, y : array_like
        Training samples as rows, labels in {-1, +1}.
    X_test, y_test : array_like, optional
        Test split (test errors are reported when given).
    state_dir : str, optional
        Default ``client-state-dir`` (state files that outlive a run, see
        :mod:`fmtl_flower.clients.mocha`).

    Notes
    -----
    ``evaluate`` returns the mean hinge loss at w_t as its loss and the test-set size as its
    count; every native metric (``loss-mean``, ``dual-mean``, ``test-errors``, ...) is in the
    metrics dict.
    """

    loss_metric = "loss-mean"

    @staticmethod
    def _native_client(load_data: Any, state_dir: str | None) -> MOCHAClient:
        from .mocha import MOCHAClient

        return MOCHAClient(load_data, state_dir=state_dir)


class FedEMNumPyClient(_NativeBackedNumPyClient):
    """A device of FedEM or one of its baselines as a ``NumPyClient``.

    Parameters
    ----------
    context : Context
        The node's context: task id from ``task-id`` / ``partition-id``; the mixture weights
        and optimiser state live in its ``state``.
    X, y : array_like
        Training samples as rows; labels {0, 1}, 0..C-1, or {-1, +1} (mapped to {0, 1}).
    X_test, y_test : array_like, optional
        Test split.
    state_dir : str, optional
        Default ``client-state-dir``.

    Notes
    -----
    ``evaluate``'s loss is the mixture's training loss; the metrics carry ``test-correct``
    and ``test-n``.
    """

    loss_metric = "train-loss"

    @staticmethod
    def _native_client(load_data: Any, state_dir: str | None) -> FedEMClient:
        from .fedem import FedEMClient

        return FedEMClient(load_data, state_dir=state_dir)

