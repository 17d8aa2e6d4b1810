"""Explicit randomness (design decision 5): every stream is derived from the run's one seed.

Each stream is a ``numpy.random.Generator`` seeded by a tuple (seed, ..., tag), or (for the
coordinate orders) a splitmix64 shuffle keyed the same way; the tag names the purpose, so
streams never collide and results repeat on every engine. Every tag of the package lives
here, and :data:`STREAMS` lists every stream's seed layout: the tags are pairwise distinct
and no two layouts can produce the same seed (``tests/core/test_rng.py``), for every seed and
id below ``2**32`` (numpy turns a larger int into several 32-bit words).
"""

from __future__ import annotations

import numpy as np

TAG_BUDGET = 11
TAG_DROP = 13
TAG_ORDER = 17
TAG_CV = 19
TAG_ARRIVALS = 43
#: The per-task train/test split, ``[seed, task, TAG_SPLIT]`` (:mod:`fmtl_flower.data.split`).
TAG_SPLIT = 7
#: The skewed task sizes ``[seed, TAG_SKEW]`` and task ``t``'s kept samples
#: ``[seed, t, TAG_SKEW]`` (:mod:`fmtl_flower.data.skew`). It was 11, the value of
#: :data:`TAG_BUDGET` with the same tuple shape: task t's skew and round t's budgets shared
#: one stream.
TAG_SKEW = 61
#: FedEM's client minibatches ``[seed, task, round, TAG_FEDEM_TRAIN]`` and fine-tuning
#: ``[seed, task, round, TAG_FEDEM_FINETUNE]`` (:mod:`fmtl_flower.clients.fedem`).
TAG_FEDEM_TRAIN = 23
TAG_FEDEM_FINETUNE = 29
#: FedEM's server: the clients sampled in a round ``[seed, round, TAG_FEDEM_SAMPLE]`` and
#: component ``m``'s initial parameters ``[seed, m, TAG_FEDEM_INIT]``.
TAG_FEDEM_SAMPLE = 31
TAG_FEDEM_INIT = 37
#: Naive FSVRG's uniform sample ``[seed, task, round, TAG_UNIFORM_SAMPLE]`` and DANE's SVRG
#: epochs ``e >= 1`` ``[seed, task, round, TAG_DANE_EPOCH, e]`` (:mod:`fmtl_flower.core.fsvrg`;
#: DANE's was 43, the value of :data:`TAG_ARRIVALS`, in a longer tuple).
TAG_UNIFORM_SAMPLE = 41
TAG_DANE_EPOCH = 53
#: The pooled model's initialisation and SGD ``[seed, TAG_POOLED_INIT]``
#: (:func:`fmtl_flower.centralized.fit_pooled_model`; was 41, :data:`TAG_UNIFORM_SAMPLE`'s value
#: in a shorter tuple).
TAG_POOLED_INIT = 59
#: The MOCHA-style synthetic generator: cluster centres ``[seed, TAG_SYNTHETIC_CENTRES]``,
#: task ``t`` ``[seed, t, TAG_SYNTHETIC_TASK]`` (:mod:`fmtl_flower.data.synthetic`). Task
#: ``t`` was ``[seed, TAG_SYNTHETIC_TASK, t]``, the tag second: it met id 94 of every
#: ``[seed, id, tag]`` stream with ``t == tag`` (synthetic task 13 drew round 94's drop mask).
TAG_SYNTHETIC_CENTRES = 0x5C
TAG_SYNTHETIC_TASK = 0x5E
#: The sparse federated generator: shared structure ``[seed, TAG_SPARSE_GLOBAL]``, node ``t``
#: ``[seed, t, TAG_SPARSE_TASK]``, the IID reshuffle ``[seed, TAG_SPARSE_IID]``
#: (:mod:`fmtl_flower.data.sparse_federated`).
TAG_SPARSE_GLOBAL = 0x5F0
TAG_SPARSE_TASK = 0x5F1
TAG_SPARSE_IID = 0x5F2
#: GD's power iteration start ``[seed, TAG_GD_POWER]``
#: (:func:`fmtl_flower.core.fsvrg.gram_power_start`).
TAG_GD_POWER = 47
#: The FedEM image reproduction: the generated images and their split
#: ``[seed, TAG_IMAGES]`` (:mod:`fmtl_flower.data.fedem_images`), the CIFAR-10/EMNIST subsample
#: ``[seed, TAG_IMAGES_SUBSAMPLE]`` and the unseen clients ``[seed, TAG_IMAGES_UNSEEN]``
#: (:mod:`fmtl_flower.experiments.fedem_images`).
TAG_IMAGES = 4242
TAG_IMAGES_SUBSAMPLE = 4243
TAG_IMAGES_UNSEEN = 77
#: The devices a strategy trains in a round when ``fraction_train`` / ``min_train_nodes``
#: sample them ``[seed, round, 0, TAG_TRAIN_SAMPLE]``
#: (:meth:`fmtl_flower.strategies.base.TaskStrategy.sample_train_tasks`; four words, so it
#: meets no ``[seed, id, tag]`` stream).
TAG_TRAIN_SAMPLE = 67
#: Barrier-free MOCHA's virtual clock: the log-normal latency factor of task ``t``'s k-th
#: request ``[seed, t, k, TAG_LATENCY]`` (:mod:`fmtl_flower.core.async_mocha`; synchronous
#: MOCHA's round k draws the same factor, so both meet the same delays).
TAG_LATENCY = 71
#: Its persistent per-device factor ``[seed, t, TAG_LATENCY_DEVICE]`` (``latency-persistence``
#: > 0) and task ``t``'s availability windows ``[seed, t, TAG_AVAILABILITY]`` (one stream of
#: alternating online / offline durations per device).
TAG_LATENCY_DEVICE = 73
TAG_AVAILABILITY = 79
#: The digits split among devices (Dirichlet label skew) and its train/test cut
#: ``[seed, TAG_DIGITS]`` (:mod:`fmtl_flower.data.digits`).
TAG_DIGITS = 27
#: Record-level DP's noise on a device's release ``[noise_seed, task, round, TAG_RECORD_DP]``
#: (:func:`fmtl_flower.core.record_dp.noise_rng`): seeded only for tests and reproducible
#: experiments, by a ``noise_seed`` the device holds (never the run's seed, which the server
#: knows); otherwise the operating system's entropy.
TAG_RECORD_DP = 83

#: Every stream: name -> seed layout. An int is a fixed word, ``"seed"`` the run seed and the
#: other names ids that range over ``0, 1, 2, ...`` (``"round"`` and ``"epoch"`` from 1).
#: ``"numpy"`` layouts seed ``np.random.default_rng(list)``; ``"splitmix"`` layouts key
#: :func:`coordinate_order`'s shuffle (a separate family: it never meets a numpy seed).
STREAMS: dict[str, tuple[str, tuple[int | str, ...]]] = {
    "split": ("numpy", ("seed", "task", TAG_SPLIT)),
    "budget": ("numpy", ("seed", "round", TAG_BUDGET)),
    "drop": ("numpy", ("seed", "round", TAG_DROP)),
    "cv-folds": ("numpy", ("seed", "task", TAG_CV)),
    "fedem-train": ("numpy", ("seed", "task", "round", TAG_FEDEM_TRAIN)),
    "fedem-finetune": ("numpy", ("seed", "task", "round", TAG_FEDEM_FINETUNE)),
    "fedem-sample": ("numpy", ("seed", "round", TAG_FEDEM_SAMPLE)),
    "fedem-init": ("numpy", ("seed", "component", TAG_FEDEM_INIT)),
    "uniform-sample": ("numpy", ("seed", "task", "round", TAG_UNIFORM_SAMPLE)),
    "arrivals": ("numpy", ("seed", TAG_ARRIVALS)),
    "skew-sizes": ("numpy", ("seed", TAG_SKEW)),
    "skew-task": ("numpy", ("seed", "task", TAG_SKEW)),
    "dane-epoch": ("numpy", ("seed", "task", "round", TAG_DANE_EPOCH, "epoch")),
    "pooled-init": ("numpy", ("seed", TAG_POOLED_INIT)),
    "synthetic-centres": ("numpy", ("seed", TAG_SYNTHETIC_CENTRES)),
    "synthetic-task": ("numpy", ("seed", "task", TAG_SYNTHETIC_TASK)),
    "sparse-global": ("numpy", ("seed", TAG_SPARSE_GLOBAL)),
    "sparse-task": ("numpy", ("seed", "task", TAG_SPARSE_TASK)),
    "sparse-iid": ("numpy", ("seed", TAG_SPARSE_IID)),
    "gd-power": ("numpy", ("seed", TAG_GD_POWER)),
    "images": ("numpy", ("seed", TAG_IMAGES)),
    "images-subsample": ("numpy", ("seed", TAG_IMAGES_SUBSAMPLE)),
    "images-unseen": ("numpy", ("seed", TAG_IMAGES_UNSEEN)),
    "train-sample": ("numpy", ("seed", "round", 0, TAG_TRAIN_SAMPLE)),
    "latency": ("numpy", ("seed", "task", "request", TAG_LATENCY)),
    "latency-device": ("numpy", ("seed", "task", TAG_LATENCY_DEVICE)),
    "availability": ("numpy", ("seed", "task", TAG_AVAILABILITY)),
    "digits": ("numpy", ("seed", TAG_DIGITS)),
    "record-dp-noise": ("numpy", ("noise-seed", "task", "round", TAG_RECORD_DP)),
    "coordinate-order": ("splitmix", ("seed", "task", "round", TAG_ORDER)),
    "global-svm-epoch": ("splitmix", ("seed", "epoch", 0, TAG_ORDER)),
}

def arrival_permutation(seed: int, num_tasks: int) -> np.ndarray:
    """The order in which tasks join for ``arrivals="shuffle"`` (OFMTL) under ``seed``."""
    return np.random.default_rng([int(seed), TAG_ARRIVALS]).permutation(num_tasks)


def round_rng(seed: int, server_round: int, tag: int) -> np.random.Generator:
    """The server's Generator for one purpose in one round."""
    return np.random.default_rng([int(seed), int(server_round), int(tag)])


def train_sample_rng(seed: int, server_round: int) -> np.random.Generator:
    """The Generator of the devices sampled to train in one round (``train-sample``)."""
    return np.random.default_rng([int(seed), int(server_round), 0, TAG_TRAIN_SAMPLE])


def evaluate_sample_rng(seed: int, server_round: int) -> np.random.Generator:
    """The Generator of the devices sampled to evaluate in one round (``evaluate-sample``:
    ``train-sample``'s tag, index 1)."""
    return np.random.default_rng([int(seed), int(server_round), 1, TAG_TRAIN_SAMPLE])


_SPLITMIX_NAMES = ("_splitmix64", "_splitmix64_numpy", "_permutation", "_permutation_numpy")


def __getattr__(name: str):
    """The compiled shuffle (:mod:`fmtl_flower.core.splitmix`) on first use, so that a module
    that only needs the tags (FedEM's client) does not load the kernels (numba)."""
    if name in _SPLITMIX_NAMES:
        from . import splitmix

        return getattr(splitmix, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def coordinate_order(seed: int, task_id: int, server_round: int, n: int) -> np.ndarray:
    """The permutation of 0..n-1 a device's SDCA visits in one round.

    A Fisher-Yates shuffle driven by splitmix64 keyed on (seed, task id, round, tag): a pure
    function of its arguments, compiled, about 100 times cheaper than seeding a numpy
    Generator for every device and round (without numba: the same permutation from Python
    integers).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    from .splitmix import _permutation

    mask = (1 << 64) - 1
    return _permutation(np.uint64(int(seed) & mask), np.uint64(int(task_id) & mask),
                        np.uint64(int(server_round) & mask), np.uint64(TAG_ORDER), int(n))
