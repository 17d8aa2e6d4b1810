"""The data of one device: its partition, by Flower Datasets' DirichletPartitioner.

The dataset is built in memory (nothing is downloaded): 3 classes given by a noisy linear
rule over 8 features, 3000 rows, seeded so that every device builds the same one.
``DirichletPartitioner`` gives device ``partition-id`` of ``num-partitions`` a non-IID share
of the classes; :func:`fmtl_flower.partition_loader` splits it 75/25 (stratified, seeded) and
keeps the labels as class ids, as FedEM's softmax components expect. With a Hugging Face
dataset instead, pass ``FederatedDataset(...).partitioners["train"]``.
"""

from functools import lru_cache

import numpy as np
from datasets import Dataset
from flwr.app import Context
from flwr_datasets.partitioner import DirichletPartitioner

from fmtl_flower import partition_loader


def make_dataset(rows: int = 3000, dim: int = 8, seed: int = 0) -> Dataset:
    """3 classes: the largest of 3 linear scores plus noise."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, dim))
    y = np.argmax(X @ rng.normal(size=(dim, 3)) + 0.5 * rng.normal(size=(rows, 3)), axis=1)
    return Dataset.from_dict({"x": X.tolist(), "label": y.tolist()})


@lru_cache(maxsize=4)
def partitioner_for(num_partitions: int) -> DirichletPartitioner:
    partitioner = DirichletPartitioner(num_partitions=num_partitions, partition_by="label",
                                       alpha=0.5, min_partition_size=30, seed=42)
    partitioner.dataset = make_dataset()
    return partitioner


def load_data(context: Context) -> tuple[np.ndarray, ...]:
    """This node's partition ``partition-id`` of ``num-partitions`` (node config)."""
    partitioner = partitioner_for(int(context.node_config["num-partitions"]))
    load = partition_loader(partitioner, features="x", label="label", labels="classes")
    return load(context)
