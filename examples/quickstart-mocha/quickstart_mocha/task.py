"""The data of one device: its partition of a synthetic federation of related tasks.

Every device draws the same seeded federation of ``num-partitions`` linear classification
tasks (three clusters of similar tasks) and keeps task ``partition-id``, split 75/25 into
train and test. Replace ``load_data`` with your own reader: it gets the node's ``Context``
and returns ``(X, y, X_test, y_test)``, rows are samples, labels in {-1, +1}.
"""

import numpy as np
from flwr.app import Context

from fmtl_flower.data import make_synthetic_tasks, train_test_split_task


def load_data(context: Context) -> tuple[np.ndarray, ...]:
    """This node's task: ``partition-id`` of ``num-partitions`` (node config)."""
    partition = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    Xs, ys = make_synthetic_tasks(num_tasks=num_partitions, dim=10, samples_per_task=80,
                                  seed=0)
    split = train_test_split_task(Xs[partition], ys[partition], 0.25,
                                  np.random.default_rng([0, partition]))
    return split.X_train, split.y_train, split.X_test, split.y_test
