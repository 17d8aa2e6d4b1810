"""The data of one device, as a legacy project's ``task.py`` would load it.

Every device draws the same seeded federation of ``num-partitions`` related linear tasks and
keeps task ``partition-id``, split 75/25; rows are samples, labels in {-1, +1}.
"""

import numpy as np

from fmtl_flower.data import make_synthetic_tasks, train_test_split_task


def load_partition(partition_id: int, num_partitions: int) -> tuple[np.ndarray, ...]:
    """``(X, y, X_test, y_test)`` of task ``partition_id``."""
    Xs, ys = make_synthetic_tasks(num_tasks=num_partitions, dim=10, samples_per_task=80,
                                  seed=0)
    split = train_test_split_task(Xs[partition_id], ys[partition_id], 0.25,
                                  np.random.default_rng([0, partition_id]))
    return split.X_train, split.y_train, split.X_test, split.y_test
