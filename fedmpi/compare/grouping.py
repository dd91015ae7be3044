"""Which runs form a group, and its label: the grouping keys (``--group-by`` with
:data:`ALIASES`, or every config key that differs between the runs but
:data:`IGNORED_KEYS`), the group labels, the baseline group, and the per-group
mean ± population std (:func:`mean_std`)."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fedmpi.errors import UserError

__all__ = ["ALIASES", "IGNORED_KEYS", "UNUSED", "find_baseline", "format_value", "group_keys",
           "mean_std", "short_key"]

#: A grouping key's value in a group whose runs did not use it (e.g. another method's
#: parameter, :func:`~fedmpi.compare.runs.run_config`).
UNUSED = "—"

#: Short names accepted by ``--group-by``.
ALIASES: dict[str, str] = {
    "algorithm": "algorithm.name",
    "weighting": "aggregation.weighting",
    "alpha": "data.partition.alpha",
    "partition": "data.partition.method",
    "dataset": "data.dataset",
    "model": "model.name",
    "clients": "data.num_clients",
    "ecgr": "ecgr.enabled",
}

#: Config keys (or prefixes ending in ".") never used for default grouping.
IGNORED_KEYS: tuple[str, ...] = ("name", "seed", "data.partition.seed", "data.partition.file",
                                 "data.root", "data.download", "data.silos.path",
                                 "data.silos.test", "data.silos.validation", "data.tabular.train",
                                 "data.tabular.test", "runtime.")


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return "none" if value is None else str(value)


def _ignored(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in IGNORED_KEYS)


def group_keys(flat_configs: Sequence[Mapping[str, Any]], group_by: Sequence[str]) -> list[str]:
    if group_by:
        keys = [ALIASES.get(k, k) for k in group_by]
        for k, given in zip(keys, group_by):
            if not any(k in c for c in flat_configs):
                raise UserError(f"--group-by {given}: no log has config key {k!r} "
                                f"(aliases: {', '.join(sorted(ALIASES))})")
        return keys
    # A key that some logs lack (added to the schema later) varies only if the
    # logs that have it disagree; but where the methods differ, each method's own
    # parameters (algorithm.<block>.<field>, present only in its runs: run_config)
    # label its groups.
    union = sorted({k for c in flat_configs for k in c})
    methods = len({format_value(c.get("algorithm.name")) for c in flat_configs}) > 1

    # Likewise an update transform's parameters (ecgr.beta) label the runs it ran in.
    from fedmpi.transforms.base import TRANSFORMS

    transform_blocks = {b for cls in TRANSFORMS.values() for b in (getattr(cls, "params", None) or ())}

    def own_param(k: str) -> bool:
        if all(k in c for c in flat_configs):
            return False
        return (methods and k.startswith("algorithm.") and k.count(".") >= 2) or \
            k.split(".")[0] in transform_blocks

    varying = [k for k in union if not _ignored(k)
               and len({format_value(c[k]) for c in flat_configs if k in c}) > 1]
    return varying + [k for k in union if k not in varying and own_param(k)]


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0 or not np.all(np.isfinite(a)):
        return math.nan, math.nan
    return float(a.mean()), float(a.std())


def short_key(key: str, keys: Sequence[str]) -> str:
    """Column name in a label: the alias of ``key``, else its last part if no other
    grouping key ends the same way, else the whole dotted key."""
    for alias, target in ALIASES.items():
        if target == key:
            return alias
    leaf = key.rsplit(".", 1)[-1]
    return leaf if sum(k.rsplit(".", 1)[-1] == leaf for k in keys) == 1 else key


def find_baseline(members, keys, flats, baseline, label) -> int | None:
    if baseline is not None:
        exact = [i for i, (values, _) in enumerate(members) if label(values) == baseline]
        if len(exact) == 1:
            return exact[0]
        loose = [i for i, (values, _) in enumerate(members) if baseline in values]
        if len(loose) == 1:
            return loose[0]
        known = "; ".join(label(v) for v, _ in members)
        what = "matches no group" if not loose else "matches several groups"
        raise UserError(f"--baseline {baseline!r} {what}; groups: {known}")
    if len(members) < 2:
        return None
    fedavg = [i for i, (_, idx) in enumerate(members)
              if all(flats[j].get("algorithm.name") == "fedavg" for j in idx)]
    return fedavg[0] if len(fedavg) == 1 else None
