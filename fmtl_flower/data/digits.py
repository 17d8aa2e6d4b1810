"""``"digits-dirichlet"``: scikit-learn's handwritten digits split among devices by label skew.

:func:`sklearn.datasets.load_digits` (bundled with scikit-learn, nothing is downloaded):
1,797 8 x 8 images, 64 pixel features in 0..16 (scaled here to [0, 1]), 10 classes. The
samples are divided among ``num_tasks`` devices by the Dirichlet label split of FedEM's
CIFAR protocol (:func:`~fmtl_flower.data.fedem_images.dirichlet_label_split`: for every
class, Dirichlet(``alpha``) shares of its samples; alpha = 0.5 gives each device a few
dominant classes), redrawn from the same stream until every device has at least
``min_samples`` samples; each device's samples are then split into train and test parts
(``test_frac``, stratified by class, :func:`~fmtl_flower.data.split.split_tasks`). Labels
are the digits 0..9 as float64: a multi-class problem for MOCHA's devices built with
``labels="auto"`` (:mod:`fmtl_flower.core.multiclass`) and class ids for the FedEM family.

:func:`validation_split` holds out part of every device's TRAINING data (stratified) to pick
hyper-parameters on, without looking at the test split.
"""

from __future__ import annotations

import numpy as np

from ..core.rng import TAG_CV, TAG_DIGITS
from .dataset import MultiTaskDataset
from .fedem_images import dirichlet_label_split
from .split import split_tasks, train_test_split_task

__all__ = ["DIGITS_DIRICHLET", "load_digits_arrays", "make_digits_dirichlet",
           "validation_split"]

DIGITS_DIRICHLET = "digits-dirichlet"
#: Redraws of the split before giving up on ``min_samples``.
MAX_DRAWS = 1000


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(X (1797, 64) float64 in [0, 1], y (1797,) int64 in 0..9) of scikit-learn's digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return np.asarray(data.data, dtype=np.float64) / 16.0, np.asarray(data.target, np.int64)


def make_digits_dirichlet(num_tasks: int = 10, alpha: float = 0.5, test_frac: float = 0.25,
                          seed: int = 0, min_samples: int = 20) -> MultiTaskDataset:
    """The digits split among ``num_tasks`` devices by Dirichlet(``alpha``) label skew.

    Parameters
    ----------
    num_tasks : int, default 10
        Devices (tasks), >= 1 and at most 1797 / ``min_samples``.
    alpha : float, default 0.5
        Dirichlet concentration (> 0); smaller is more skewed.
    test_frac : float, default 0.25
        Per-class test fraction of every device.
    seed : int, default 0
        Seeds the split (``np.random.default_rng([seed, TAG_DIGITS])``,
        :mod:`fmtl_flower.core.rng`) and the train/test cut.
    min_samples : int, default 20
        Fewest samples a device may get (the split is redrawn until each has as many).

    Returns
    -------
    MultiTaskDataset
        Named ``"digits-dirichlet"``; labels 0..9 (float64).
    """
    X, y = load_digits_arrays()
    if not (isinstance(num_tasks, int) and 1 <= num_tasks <= len(y) // max(min_samples, 1)):
        raise ValueError(f"num_tasks must be an int in 1..{len(y) // max(min_samples, 1)}, "
                         f"got {num_tasks!r}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    rng = np.random.default_rng([seed, TAG_DIGITS])
    for _ in range(MAX_DRAWS):
        parts = dirichlet_label_split(y, num_tasks, alpha, rng)
        if min(p.size for p in parts) >= min_samples:
            break
    else:
        raise ValueError(f"no Dirichlet({alpha}) split of the digits gave each of {num_tasks} "
                         f"devices {min_samples} samples in {MAX_DRAWS} draws")
    return split_tasks([X[p] for p in parts], [y[p].astype(np.float64) for p in parts],
                       test_frac, seed, DIGITS_DIRICHLET)


def validation_split(data: MultiTaskDataset, val_frac: float = 0.2,
                     seed: int = 0) -> MultiTaskDataset:
    """Every device's training data split into a fitting part and a validation part.

    The test split is not read: task ``t``'s training samples are cut by
    :func:`~fmtl_flower.data.split.train_test_split_task` (stratified by class; a class with
    one training sample stays in the fitting part) with ``np.random.default_rng([seed, t,
    TAG_CV])``, the tag of :mod:`fmtl_flower.model_selection`'s folds.

    Parameters
    ----------
    data : MultiTaskDataset
        The dataset whose training parts are split (e.g. :func:`make_digits_dirichlet`'s).
    val_frac : float, default 0.2
        Per-class share of each device's training samples held out, in (0, 1).
    seed : int, default 0
        Seeds the cut.

    Returns
    -------
    MultiTaskDataset
        Named ``"<name>-validation"``: each task's ``X_train, y_train`` the fitting part and
        its ``X_test, y_test`` the validation part.
    """
    if not 0.0 < val_frac < 1.0:
        raise ValueError(f"val_frac must be in (0, 1), got {val_frac!r}")
    tasks = tuple(train_test_split_task(task.X_train, task.y_train, val_frac,
                                        np.random.default_rng([seed, t, TAG_CV]),
                                        name=f"{data.name}: task {t}")
                  for t, task in enumerate(data.tasks))
    return MultiTaskDataset(name=f"{data.name}-validation", tasks=tasks)
