"""FedEM (and its baselines) for PyTorch projects: the ClientApp over a user's ``nn.Module``.

The device side of :class:`fmtl_flower.strategies.fedem.FedEM` with ``model="torch"``: the
same handlers, state and wire contract as :mod:`fmtl_flower.clients.fedem` (E-step, pi,
per-component momentum kept on the device, unseen clients fitting only pi), with the
components trained through :class:`fmtl_flower.core.torch_backend.TorchBackend`. The
components travel as flat float64 vectors of the module's ``state_dict`` (weights and
BatchNorm buffers); every message names the layout (``layout``, a signature of the
state_dict's keys, shapes and dtypes) and a device whose ``model_fn()`` has another layout
refuses it with an error naming both.

torch is imported when the first message is handled, not when this module is imported.

Example
-------
>>> import torch  # doctest: +SKIP
>>> def model_fn():  # doctest: +SKIP
...     return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
>>> def load_data(context):  # doctest: +SKIP
...     return X_train, y_train, X_test, y_test   # numpy arrays or torch Datasets
>>> app = make_fedem_torch_client_app(model_fn, load_data)  # doctest: +SKIP

and on the server ``FedEM(num_tasks=K, method="fedem", num_components=3, model="torch",
initial_components=[ArrayRecord(model_fn().state_dict()) for _ in range(3)])``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from flwr.clientapp import ClientApp

from .common import client_app_for, config_value
from .fedem import DataLoader, FedEMClient, TaskIdFn

__all__ = ["TorchFedEMClient", "make_fedem_torch_client_app"]


def _as_arrays(data: Any, name: str) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """A torch Dataset of (x, label) pairs as (X, y) numpy arrays; arrays unchanged."""
    if isinstance(data, np.ndarray):
        return data
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(
            data, list | tuple):
        import torch

        if isinstance(data, torch.Tensor):
            return data.detach().cpu().numpy()
        if isinstance(data, torch.utils.data.Dataset):
            items = [data[i] for i in range(len(data))]
            if not items:
                raise ValueError(f"{name}: the dataset is empty")
            X = np.stack([np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)
                          for x, _ in items])
            y = np.array([int(label) for _, label in items], dtype=np.int64)
            return X, y
    return np.asarray(data)


class TorchFedEMClient(FedEMClient):
    """:class:`fmtl_flower.clients.fedem.FedEMClient` with a torch module as the model.

    Parameters
    ----------
    model_fn : callable
        ``model_fn()`` returns a fresh ``torch.nn.Module`` producing logits (built once per
        ClientApp process; its weights are overwritten by the components).
    load_data : callable
        ``load_data(context)`` returns ``(X_train, y_train, X_test, y_test)`` as numpy arrays
        (samples along axis 0, any shape after it; floating inputs for images), or
        ``(train_dataset, test_dataset)`` as torch Datasets of ``(x, label)`` pairs, or
        ``(X_train, y_train)``. Labels are class indices (or {-1, +1}).
    task_id, state_dir
        As for :class:`fmtl_flower.clients.fedem.FedEMClient`.
    device : str
        Torch device of the module (``"cpu"``).
    eval_batch_size : int
        Chunk size of the forward passes of the E-step and of evaluation.
    """

    def __init__(self, model_fn: Callable[[], Any], load_data: DataLoader,
                 task_id: TaskIdFn | None = None, state_dir: str | None = None,
                 device: str = "cpu", eval_batch_size: int = 1024) -> None:
        super().__init__(load_data, task_id, state_dir)
        if not callable(model_fn):
            raise ValueError("model_fn must be callable (it returns a fresh nn.Module)")
        self._model_fn = model_fn
        self._device = device
        self._eval_batch_size = int(eval_batch_size)
        self._backend: Any = None

    def backend(self) -> Any:
        """The :class:`TorchBackend` of ``model_fn`` (built on first use; imports torch)."""
        if self._backend is None:
            try:
                from ..core.torch_backend import TorchBackend
            except ImportError as err:
                raise ImportError(f"FedEM's torch backend needs torch ({err}): pip install "
                                  '"fmtl-flower[torch]"') from err

            self._backend = TorchBackend(self._model_fn, self._device, self._eval_batch_size)
        return self._backend

    @staticmethod
    def features(loaded, name: str) -> tuple[np.ndarray, Any, np.ndarray, Any]:
        """``load_data``'s output as checked features of any sample shape (float inputs kept
        in their dtype: float64 stays float64) and raw labels; torch Datasets are read into
        arrays. The labels become int64 classes in :meth:`FedEMClient.client_data`."""
        loaded = tuple(loaded)
        if len(loaded) == 2 and all(isinstance(_as_arrays(part, name), tuple)
                                    for part in loaded):
            (X, y), (X_test, y_test) = (_as_arrays(part, name) for part in loaded)
        elif len(loaded) == 2:
            X, y = (_as_arrays(part, name) for part in loaded)
            X_test, y_test = np.zeros((0, *np.shape(X)[1:]), dtype=np.asarray(X).dtype), \
                np.zeros(0)
        elif len(loaded) == 4:
            X, y, X_test, y_test = (_as_arrays(part, name) for part in loaded)
        else:
            raise ValueError(f"{name}: load_data must return (X, y, X_test, y_test), (X, y) or "
                             f"(train_dataset, test_dataset); got {len(loaded)} items")
        X, X_test = np.ascontiguousarray(X), np.ascontiguousarray(X_test)
        if X.ndim < 1 or X.shape[0] < 1 or X_test.shape[1:] != X.shape[1:]:
            raise ValueError(f"{name}: X must be (n >= 1, ...) and X_test (n_test, ...) of the "
                             f"same sample shape; got {X.shape} and {X_test.shape}")
        for part in (X, X_test):
            if np.issubdtype(part.dtype, np.floating) and not np.all(np.isfinite(part)):
                raise ValueError(f"{name}: features must be finite")
        if X.ndim == 1:  # one feature per sample: a column
            X, X_test = X[:, None], X_test[:, None]
        return X, y, X_test, y_test

    def model(self, config: ConfigRecord, dim: int) -> Any:
        """The torch backend, after checking the message is for ``model="torch"`` with this
        module's state_dict layout."""
        name = config_value(config, "model", str)
        if name != "torch":
            raise ValueError(f"this ClientApp serves model='torch', the message asks for "
                             f"{name!r}")
        backend = self.backend()
        layout = config_value(config, "layout", str)
        if layout != backend.signature:
            raise ValueError(f"the server's components have layout {layout!r}, this device's "
                             f"model_fn() has {backend.signature!r} (state_dict keys, shapes "
                             "or dtypes differ)")
        return backend


def make_fedem_torch_client_app(model_fn: Callable[[], Any], load_data: DataLoader,
                                **options: Any) -> ClientApp:
    """A ClientApp serving FedEM and its baselines over a torch module.

    Parameters
    ----------
    model_fn : callable
        Returns a fresh ``torch.nn.Module`` producing logits ``(n, C)`` (cross-entropy per
        sample) or ``(n,)``/``(n, 1)`` (binary, BCE-with-logits).
    load_data : callable
        ``load_data(context) -> (X_train, y_train, X_test, y_test)`` numpy arrays, or
        ``(train_dataset, test_dataset)`` torch Datasets; labels as class indices.
    **options
        ``task_id`` (callable), ``state_dir`` (str), ``device`` (str, default ``"cpu"``),
        ``eval_batch_size`` (int): see :class:`TorchFedEMClient`.
    """
    allowed = {"task_id", "state_dir", "device", "eval_batch_size"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; expected some of {sorted(allowed)}")
    return client_app_for(TorchFedEMClient(model_fn, load_data, **options))

