"""What a run actually ran, for its log and everything that reads it (issue 26).

A config holds every key with its default, also keys the run never used: a silo
run still has ``data.dataset: digits``, a user model still has ``model.norm: bn``,
a user method still has every built-in method's parameter block. Two things keep
the report, ``compare`` and ``partition`` truthful:

* :func:`run_info` — written by rank 0 into the log's root attribute ``run_info``
  (JSON; docs/hdf5-log.md): the model, data, method, weighting, server rule and update
  transforms as they ran — built-in name or import path (``module:qualname``), each one's
  own parameters (its ``params`` blocks as instantiated, e.g. ``{"params": {"mu": 0.1}}``
  for a user method), and for silo data every file read with its SHA-256 (each hashed
  on the rank that read it, :mod:`fedmpi.data.silos`) and the sites' names
  (:func:`fedmpi.data.silos.site_names`, what every per-site plot and table shows).
* :func:`unused_keys` — the config keys whose values took no part in a run, from the
  config alone (and ``run_info`` where the log has it): what report tables and
  ``compare`` groups leave out.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Optional, Sequence
from fedmpi.config.core import Config

__all__ = ["RUN_INFO_ATTR", "method_params", "run_info", "unused_keys"]

RUN_INFO_ATTR = "run_info"

#: Keys a silo run (``data.partition.method: silos``) does not use: the pooled dataset
#: and how it would be cut (``fedmpi partition --export``'s business, not the run's).
_POOLED_ONLY = ("data.dataset", "data.root", "data.download", "data.image_size",
                "data.partition.alpha", "data.partition.classes_per_client",
                "data.partition.min_size", "data.partition.file", "data.partition.seed",
                "data.silos.split", "data.tabular.train", "data.tabular.test",
                "data.validation.fraction")
#: Built-in models whose layers take ``model.norm``.
_NORMED = ("cnn", "resnet")


def _is_path(name: Any) -> bool:
    from fedmpi.imports import is_import_path

    return is_import_path(name)


def method_params(algo: Any) -> dict[str, dict[str, Any]]:
    """The method's parameters as it uses them: each block it declares
    (``Algorithm.params``) as instantiated, ``{block: {field: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for group in getattr(type(algo), "params", None) or {}:
        value = algo.hparams(group)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[group] = json.loads(json.dumps(dataclasses.asdict(value), default=str))
    return out


def run_info(cfg: Config, algo: Any, weighting: Any, transforms: Sequence[Any],
             model: Any = None, files: Sequence[tuple[str, str, str]] = (),
             rule: Any = None) -> dict[str, Any]:
    """The ``run_info`` record of the module docstring. ``model``: the factory given to
    :func:`fedmpi.run` (None: ``model.name``); ``files``: ``(role, path, sha256)`` of the
    silo files read; ``rule``: the server rule (``aggregation.rule``)."""
    from fedmpi.imports import code_path

    def named(obj: Any, fallback: str) -> str:
        path = code_path(obj) if obj is not None else None
        return path if path is not None and not path.startswith(("fedmpi.", "builtins")) \
            else fallback

    def transform_name(t: Any) -> str:
        from fedmpi.transforms.base import TRANSFORMS

        registered = [k for k, cls in TRANSFORMS.items() if cls is type(t)]
        return named(type(t), registered[0] if registered else type(t).__name__)

    model_name = named(model, str(cfg.model.name)) if model is not None else str(cfg.model.name)
    model_info: dict[str, Any] = {"name": model_name}
    if model_name == "mlp":
        model_info["hidden"] = list(cfg.model.mlp.hidden)
    elif model_name.startswith(_NORMED):
        model_info["norm"] = cfg.model.norm
    silos = cfg.data.partition.method == "silos"
    data: dict[str, Any] = {"num_clients": cfg.data.num_clients,
                            "partition": cfg.data.partition.method}
    if silos:
        from fedmpi.data.silos import shown_path, site_names

        template = cfg.data.silos.path
        data["silos"] = {"path": shown_path(template) if template is not None else None, "loader": cfg.data.silos.loader,
                         "names": site_names(cfg),
                         "files": [{"role": r, "path": p, "sha256": h} for r, p, h in files]}
    else:
        data["dataset"] = str(cfg.data.dataset)
    return {
        "model": model_info,
        "data": data,
        "method": {"name": named(type(algo), str(cfg.algorithm.name)),
                   "server_lr": float(algo.server_lr), "params": method_params(algo)},
        "weighting": named(type(weighting), str(cfg.aggregation.weighting)),
        "rule": ({"name": named(type(rule), str(cfg.aggregation.rule)),
                  "params": method_params(rule)} if rule is not None else None),
        "weighting_params": method_params(weighting),
        "transforms": [transform_name(t) for t in transforms],
        "transform_params": {transform_name(t): method_params(t) for t in transforms},
    }


def read_run_info(attrs: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """A log's ``run_info`` (None for logs written before it existed or unreadable)."""
    text = attrs.get(RUN_INFO_ATTR)
    if not isinstance(text, str):
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def unused_keys(flat: Mapping[str, Any], info: Optional[Mapping[str, Any]] = None) -> set[str]:
    """Keys of the flat config ``flat`` that took no part in the run (module docstring):
    a silo run's pooled-data keys; the silo keys of a pooled run; ``model.*`` but the
    name for a model given by import path, ``model.norm`` for models without it; the
    parameter blocks of methods other than the one that ran (from ``info``'s
    ``method.params`` where given, else from the built-in method's declaration); the
    blocks of registered transforms that did not run (``transform_params``) but their
    ``enabled`` switch."""
    unused: set[str] = set()
    silos = flat.get("data.partition.method") == "silos"
    for key in flat:
        if silos and key in _POOLED_ONLY:
            unused.add(key)
        elif not silos and key.startswith("data.silos."):
            unused.add(key)
    model = str(flat.get("model.name", ""))
    for key in flat:
        if key.startswith("model.") and key != "model.name":
            if _is_path(model) or (key == "model.norm" and not model.startswith(_NORMED)) or \
                    (key.startswith("model.mlp.") and model != "mlp"):
                unused.add(key)
    blocks, ran = _transform_groups(info)
    for key in flat:   # an off transform's parameters (its switch, ``<block>.enabled``, counts)
        parts = key.split(".")
        if parts[0] in blocks and parts[0] not in ran and parts[-1] != "enabled":
            unused.add(key)
    groups = _method_groups(flat, info)
    rule_blocks, rule_used = _rule_groups(flat, info)
    for key in flat:
        parts = key.split(".")
        if len(parts) > 2 and parts[0] == "algorithm" and groups is not None and \
                parts[1] not in groups:
            unused.add(key)
        if len(parts) > 2 and parts[0] == "aggregation" and parts[1] in rule_blocks and \
                parts[1] not in rule_used:
            unused.add(key)
    return unused


def _transform_groups(info: Optional[Mapping[str, Any]]) -> tuple[set[str], set[str]]:
    """(the config blocks of every registered transform, those of the transforms that ran);
    both empty for logs without ``transform_params`` (nothing can be said from the config)."""
    ran = info.get("transform_params") if info is not None else None
    if not isinstance(ran, Mapping):
        return set(), set()
    from fedmpi.transforms.base import TRANSFORMS

    blocks = {b for cls in TRANSFORMS.values() for b in (getattr(cls, "params", None) or ())}
    return blocks, {b for p in ran.values() if isinstance(p, Mapping) for b in p}


def _rule_groups(flat: Mapping[str, Any], info: Optional[Mapping[str, Any]]
                 ) -> tuple[set[str], set[str]]:
    """(``aggregation.<block>`` names of every server rule, those of the run's rule)."""
    from fedmpi.aggregation.rules import RULES

    blocks = {g for cls in RULES.values() for g in (getattr(cls, "params", None) or ())}
    blocks.add("params")
    rule = info.get("rule") if info is not None else None
    if isinstance(rule, Mapping) and isinstance(rule.get("params"), Mapping):
        return blocks, set(rule["params"])
    name = str(flat.get("aggregation.rule", "mean"))
    if _is_path(name):
        return blocks, {"params"}
    cls = RULES.get(name)
    return blocks, set(getattr(cls, "params", None) or ()) if cls is not None else blocks


def _method_groups(flat: Mapping[str, Any], info: Optional[Mapping[str, Any]]) -> Optional[set[str]]:
    """The ``algorithm.<block>`` names the run's method reads (None: unknown)."""
    if info is not None and isinstance(info.get("method"), Mapping):
        params = info["method"].get("params")
        if isinstance(params, Mapping):
            return set(params)
    name = flat.get("algorithm.name")
    if _is_path(name):
        return {"params"}
    from fedmpi.methods import ALGORITHMS

    cls = ALGORITHMS.get(str(name))
    return set(getattr(cls, "params", None) or ()) if cls is not None else None
