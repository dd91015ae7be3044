"""Datasets (raw tensors + on-device preprocessing) and federated partitions."""
from __future__ import annotations

from fedmpi.data.base import Dataset
from fedmpi.data.build import DataNeeds, build_partition, load_pool
from fedmpi.data.datasets import DATASET_NAMES, load_dataset, synthetic_dataset
from fedmpi.data.partition import PARTITION_METHODS, Partition, make_partition, stratified_holdout
from fedmpi.data.silos import LocalData, build_local

__all__ = [
    "DATASET_NAMES",
    "DataNeeds",
    "PARTITION_METHODS",
    "Dataset",
    "LocalData",
    "Partition",
    "build_local",
    "build_partition",
    "load_dataset",
    "load_pool",
    "make_partition",
    "stratified_holdout",
    "synthetic_dataset",
]
