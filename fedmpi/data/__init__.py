"""Datasets (raw tensors + on-device preprocessing) and federated partitions."""
