"""FedEM's model backend for any ``torch.nn.Module`` that maps a batch of inputs to logits.

Importing this module imports torch (an optional extra: ``pip install "fmtl-flower[torch]"``);
nothing else in the package does, so projects without torch never load it.

* **Loss**: cross-entropy per sample on the logits (``(n, C)``, C >= 2, labels 0..C-1); a
  module with one output (``(n,)`` or ``(n, 1)``) is a binary logistic model with
  BCE-with-logits (labels 0/1), like :class:`fmtl_flower.core.models.LogisticModel`.
* **Evaluation** (losses for the E-step, probabilities) runs in ``eval()`` mode without
  gradients, in chunks of ``eval_batch_size``; **training** in ``train()`` mode.
* **Local solver**: the same update as :func:`fmtl_flower.core.local_sgd.sgd_epochs` (torch's
  SGD rule with momentum, weight decay and the optional FedProx term, on the weighted batch
  loss (1/|batch|) sum_i w_i l_i, batches in the order ``rng.permutation(n)``), applied to the
  module's trainable parameters; the momentum buffer is the per-component optimiser state.
* **Parameters**: the flat float64 vector is the module's ``state_dict`` (parameters *and*
  buffers, e.g. BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``) in its
  order, each entry raveled and stored exactly in float64. FedEM averages the whole vector, so
  BatchNorm's running statistics are averaged with the weights, as the authors' code does
  (``num_batches_tracked`` is averaged and rounded, where the authors sum it; it only
  matters for BatchNorm with ``momentum=None``). Entries that are not trainable keep a zero
  momentum.

The inputs X may have any shape ``(n, ...)`` (images ``(n, C, H, W)``, sequences, ...):
floating inputs are converted to the dtype of the module's first floating parameter, integer
inputs (token ids for an embedding) to int64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .backend import (
    LayoutEntry,
    check_flat_params,
    flatten_arrays,
    layout_signature,
    unflatten_arrays,
)
from .local_sgd import SGDConfig

__all__ = ["TorchBackend"]


class TorchBackend:
    """A torch module as a :class:`fmtl_flower.core.backend.ModelBackend`.

    Parameters
    ----------
    model_fn : callable
        ``model_fn()`` returns a fresh ``torch.nn.Module`` producing logits. One instance is
        built and reused (its weights are overwritten by every call).
    device : str
        Torch device (``"cpu"`` by default).
    eval_batch_size : int
        Chunk size of the forward passes without gradients.
    """

    name = "torch"

    def __init__(self, model_fn: Callable[[], torch.nn.Module], device: str = "cpu",
                 eval_batch_size: int = 1024) -> None:
        net = model_fn()
        if not isinstance(net, torch.nn.Module):
            raise ValueError(f"model_fn must return a torch.nn.Module, got {type(net).__name__}")
        self.device = torch.device(device)
        self.net = net.to(self.device)
        self.eval_batch_size = int(eval_batch_size)
        state = self.net.state_dict()
        self._entries: list[tuple[str, torch.Tensor, slice]] = []
        self._layout: list[LayoutEntry] = []
        start = 0
        for key, tensor in state.items():
            try:
                dtype = str(torch.empty(0, dtype=tensor.dtype).numpy().dtype)
            except TypeError:
                raise ValueError(f"state_dict entry {key!r} has dtype {tensor.dtype}, which "
                                 "numpy cannot hold") from None
            size = tensor.numel()
            self._entries.append((key, tensor, slice(start, start + size)))
            self._layout.append((key, tuple(tensor.shape), dtype))
            start += size
        self.num_params = start
        names = {id(t): k for k, t in self.net.named_parameters()}
        by_key = {key: sl for key, _, sl in self._entries}
        self._trainable: list[tuple[torch.nn.Parameter, slice]] = []
        for param in self.net.parameters():
            if param.requires_grad:
                key = names[id(param)]
                if key not in by_key:
                    raise ValueError(f"parameter {key!r} is not in the module's state_dict")
                self._trainable.append((param, by_key[key]))
        floating = [p.dtype for p in self.net.parameters() if p.is_floating_point()]
        self.dtype = floating[0] if floating else torch.get_default_dtype()
        self.signature = layout_signature(self._layout)
        self.num_classes: int | None = None  # known after the first forward pass

    def __repr__(self) -> str:
        return (f"TorchBackend({type(self.net).__name__}, num_params={self.num_params}, "
                f"layout={self.signature})")

    # -- parameters ----------------------------------------------------------------------
    def layout(self) -> list[LayoutEntry]:
        """(state_dict key, shape, numpy dtype name) of every entry, in order."""
        return list(self._layout)

    def initial_params(self) -> np.ndarray:
        """The flat vector of the freshly built module (its own initialisation)."""
        return self.read_params()

    def read_params(self) -> np.ndarray:
        """The module's current state_dict as a flat float64 vector."""
        return flatten_arrays({k: t.detach().cpu().numpy() for k, t, _ in self._entries})

    def param_arrays(self, params: np.ndarray) -> dict[str, np.ndarray]:
        """``params`` as the module's state_dict arrays (numpy, in their dtypes)."""
        return unflatten_arrays(self.check_params(params), self._layout)

    def check_params(self, params) -> np.ndarray:
        """``params`` as a finite float64 (num_params,) array (ValueError otherwise)."""
        return check_flat_params(params, self.num_params, self)

    def load(self, params: np.ndarray) -> None:
        """Write ``params`` into the module (in place, dtypes converted)."""
        arrays = self.param_arrays(params)
        with torch.no_grad():
            for key, tensor, _ in self._entries:
                tensor.copy_(torch.from_numpy(arrays[key]).reshape(tensor.shape))

    # -- data ------------------------------------------------------------------------------
    def _inputs(self, X) -> torch.Tensor:
        """Floating inputs in the module's dtype; integer inputs (token ids) as int64."""
        out = X if isinstance(X, torch.Tensor) else torch.as_tensor(np.asarray(X))
        if out.ndim < 1:
            raise ValueError(f"X must have a sample axis, got shape {tuple(out.shape)}")
        kind = self.dtype if out.is_floating_point() else torch.int64
        return out.to(device=self.device, dtype=kind)

    def _labels(self, y, n: int) -> torch.Tensor:
        arr = np.asarray(y)
        if arr.ndim != 1 or arr.shape[0] != n:
            raise ValueError(f"y must have shape ({n},), got shape {arr.shape}")
        if arr.size and (np.any(arr < 0) or np.any(arr != np.round(arr))):
            raise ValueError("y must hold class indices 0..C-1")
        return torch.as_tensor(arr.astype(np.int64), device=self.device)

    def _check_logits(self, logits: torch.Tensor, n: int) -> bool:
        """True for a binary (one-logit) module; fixes ``num_classes``."""
        if logits.ndim == 1 or (logits.ndim == 2 and logits.shape[1] == 1):
            classes, binary = 2, True
        elif logits.ndim == 2 and logits.shape[1] >= 2:
            classes, binary = int(logits.shape[1]), False
        else:
            raise ValueError(f"the module must return logits of shape (n, C) or (n,), got "
                             f"{tuple(logits.shape)}")
        if logits.shape[0] != n:
            raise ValueError(f"the module returned {logits.shape[0]} rows for {n} samples")
        self.num_classes = classes
        return binary

    def _losses(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        binary = self._check_logits(logits, y.shape[0])
        if y.numel() and int(y.max()) >= self.num_classes:
            raise ValueError(f"y has labels outside 0..{self.num_classes - 1}")
        if binary:
            z = logits.reshape(-1)
            return F.binary_cross_entropy_with_logits(z, y.to(z.dtype), reduction="none")
        return F.cross_entropy(logits, y, reduction="none")

    def _chunks(self, n: int):
        for start in range(0, n, self.eval_batch_size):
            yield slice(start, min(n, start + self.eval_batch_size))

    # -- backend interface -----------------------------------------------------------------
    def per_sample_loss(self, params: np.ndarray, X, y) -> np.ndarray:
        """-log p(y_i | x_i) of every sample (eval mode, no gradients), float64 (n,)."""
        self.load(params)
        Xt = self._inputs(X)
        yt = self._labels(y, Xt.shape[0])
        self.net.eval()
        with torch.no_grad():
            parts = [self._losses(self.net(Xt[s]), yt[s]) for s in self._chunks(Xt.shape[0])]
        if not parts:
            return np.zeros(0)
        return torch.cat(parts).detach().cpu().double().numpy()

    def predict_proba(self, params: np.ndarray, X) -> np.ndarray:
        """Class probabilities (n, C) (eval mode): softmax, or [1 - p, p] for one logit."""
        self.load(params)
        Xt = self._inputs(X)
        self.net.eval()
        parts = []
        with torch.no_grad():
            for s in self._chunks(Xt.shape[0]):
                logits = self.net(Xt[s]).double()
                if self._check_logits(logits, s.stop - s.start):
                    z = logits.reshape(-1)
                    parts.append(torch.stack([torch.sigmoid(-z), torch.sigmoid(z)], dim=1))
                else:
                    parts.append(torch.softmax(logits, dim=1))
        if not parts:
            return np.zeros((0, self.num_classes or 2))
        return torch.cat(parts).cpu().numpy()

    def sgd_epochs(self, params: np.ndarray, momentum_buf: np.ndarray, X, y,
                   sample_weight: np.ndarray, config: SGDConfig, rng: np.random.Generator,
                   anchor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """Weighted mini-batch SGD with momentum on the module (train mode); see the module
        docstring. Returns (new params, new momentum buffer, mean weighted batch loss)."""
        if not isinstance(config, SGDConfig):
            raise ValueError(f"config must be an SGDConfig, got {type(config).__name__}")
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy Generator, got {type(rng).__name__}")
        try:
            buf_flat = self.check_params(momentum_buf)
        except ValueError as err:
            raise ValueError(f"momentum_buf: {err}") from None
        self.load(params)
        Xt = self._inputs(X)
        n = Xt.shape[0]
        if n < 1:
            raise ValueError("X must have at least one sample")
        yt = self._labels(y, n)
        w = np.asarray(sample_weight, dtype=np.float64)
        if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError(f"sample_weight must be finite, nonnegative, of shape ({n},)")
        wt = torch.as_tensor(w, dtype=self.dtype, device=self.device)
        bufs = [torch.as_tensor(buf_flat[sl], device=self.device).to(p.dtype).reshape(p.shape)
                for p, sl in self._trainable]
        mu = config.prox_mu
        if mu > 0:
            centre_flat = self.check_params(params if anchor is None else anchor)
            centres = [torch.as_tensor(centre_flat[sl], device=self.device).to(p.dtype)
                       .reshape(p.shape) for p, sl in self._trainable]
        lr, beta, wd, bs = config.lr, config.momentum, config.weight_decay, config.batch_size
        self.net.train()
        total, batches = 0.0, 0
        for _ in range(config.epochs):
            order = torch.as_tensor(rng.permutation(n), device=self.device)
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                size = idx.shape[0]
                self.net.zero_grad(set_to_none=True)
                loss = (wt[idx] * self._losses(self.net(Xt[idx]), yt[idx])).sum() / size
                loss.backward()
                total += float(loss.detach())
                batches += 1
                with torch.no_grad():
                    for k, (p, _) in enumerate(self._trainable):
                        g = p.grad if p.grad is not None else torch.zeros_like(p)
                        if wd:
                            g = g + wd * p
                        if mu > 0:
                            g = g + mu * (p - centres[k])
                        bufs[k].mul_(beta).add_(g)
                        p.sub_(lr * bufs[k])
        self.net.zero_grad(set_to_none=True)
        new_buf = np.zeros(self.num_params)
        for (_, sl), b in zip(self._trainable, bufs, strict=True):
            new_buf[sl] = b.detach().cpu().double().numpy().reshape(-1)
        return self.read_params(), new_buf, total / batches
