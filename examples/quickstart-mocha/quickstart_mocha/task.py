"""The data of one device: its partition of a synthetic federation of related 3-class tasks.

Every device draws the same seeded federation of ``num-partitions`` tasks and keeps task
``partition-id``, split 75/25 into train and test. Each task classifies points into three
classes, ``"red"``, ``"green"`` and ``"blue"``, around class centres that are shared by all
tasks, moved by a shift common to the task's group (three groups of similar tasks) and by a
small shift of its own; the centres sit away from the origin, so the models need their
intercept. Replace ``load_data`` with your own reader: it gets the node's ``Context`` and
returns ``(X, y, X_test, y_test)``, rows are samples, labels any K distinct values (numbers
or strings; the run learns the class list from the devices at discovery).
"""

import numpy as np
from flwr.app import Context

CLASSES = np.array(["red", "green", "blue"])
DIM, SAMPLES, GROUPS = 10, 120, 3


def make_tasks(num_tasks: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """``(X, y, X_test, y_test)`` of every task of the seeded federation."""
    rng = np.random.default_rng(seed)
    centres = 3.0 + 1.5 * rng.normal(size=(len(CLASSES), DIM))  # far from the origin
    group_shift = rng.normal(size=(GROUPS, DIM))
    tasks = []
    for t in range(num_tasks):
        shift = group_shift[t % GROUPS] + 0.3 * rng.normal(size=DIM)
        labels = rng.integers(0, len(CLASSES), SAMPLES)
        X = centres[labels] + shift + 1.5 * rng.normal(size=(SAMPLES, DIM))
        cut = SAMPLES * 3 // 4
        tasks.append((X[:cut], CLASSES[labels[:cut]], X[cut:], CLASSES[labels[cut:]]))
    return tasks


def load_data(context: Context) -> tuple[np.ndarray, ...]:
    """This node's task: ``partition-id`` of ``num-partitions`` (node config)."""
    partition = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    return make_tasks(num_partitions)[partition]
