"""Run configuration: typed schema, YAML loading, ``--set`` overrides, validation.

Every config key is one entry of :data:`SCHEMA`, a flat mapping from a dotted
key (``"train.lr"``) to a :class:`Field` that declares its type, default,
allowed choices and range. Adding a key is one line there; the loader, the
validator, :meth:`Config.to_dict` and the nested attribute access pick it up.

Sources are applied in this order, later ones winning::

    defaults  <  YAML file  <  --set KEY=VALUE overrides

and the merged result is validated once: unknown keys, wrong types and
out-of-range values per field, then the cross-field rules of
:func:`_cross_checks`. Every problem raises :class:`~fedmpi.errors.ConfigError`
with a one-line message that names the dotted key (or the file) and says what
is expected.

Typing rules: an integer is accepted where a float is expected (and stored as
float); ``bool`` is never an integer; a string is never a number; lists are
typed (``list[int]``, ``list[float]``); ``null`` is accepted only for fields
whose type is ``X | None``.

YAML is read with a safe loader that also recognises exponent floats without
a decimal point (``1e-8``), which plain YAML 1.1 would read as a string.

Longer than ~350 lines on purpose: the schema, the loader and every validation rule in one place, so one file says what each key means and accepts.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedmpi.errors import ConfigError

__all__ = ["SCHEMA", "Field", "Section", "Config", "load_config", "config_from_dict"]


# --------------------------------------------------------------------------- #
# Schema
# --------------------------------------------------------------------------- #
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               dict: "a mapping"}
_ITEM_NAMES = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


@dataclass(frozen=True)
class Field:
    """Declaration of one config key.

    Args:
        type: ``int``, ``float``, ``str``, ``bool``, ``list[int]``, ``list[float]``,
            ``list[str]``, each optionally ``| None`` (then ``null`` is allowed); or
            ``dict``: a free-form mapping (``algorithm.params``) whose entries are
            validated later by whoever consumes them, set whole or entry by entry
            (``--set algorithm.params.width=8``).
        default: value used when no source sets the key.
        help: one-line description for humans.
        choices: allowed values (strings; for ``list[str]`` each item). Together
            with ``pattern``, a value is accepted if it is one of the choices *or*
            fully matches the pattern.
        pattern: regular expression (``re.fullmatch``) for accepted strings.
        pattern_help: how to describe ``pattern`` in error messages.
        ge, gt, le, lt: inclusive / exclusive bounds for numbers (for lists:
            for each item).
        file: the value is a file path; a relative path is resolved against
            the config file's directory when it exists there, else the CWD,
            and stored absolute.
    """

    type: Any
    default: Any
    help: str = ""
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    pattern_help: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    file: bool = False
    #: the value names an entry of a live registry ("algorithm" or "weighting"):
    #: ``choices`` lists the built-ins for the docs; names registered later count too
    registry: str | None = None
    # Derived from ``type`` in __post_init__.
    base: type = field(init=False, repr=False, compare=False)
    item: type | None = field(init=False, repr=False, compare=False)
    optional: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tp, optional = self.type, False
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                raise TypeError(f"unsupported field type {tp!r}")
            tp, optional = args[0], True
        item = None
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            tp = list
        if tp not in (int, float, str, bool, list, dict) or item not in (None, int, float, str, bool):
            raise TypeError(f"unsupported field type {self.type!r}")
        object.__setattr__(self, "base", tp)
        object.__setattr__(self, "item", item)
        object.__setattr__(self, "optional", optional)

    @property
    def type_name(self) -> str:
        """Human name of the accepted type, e.g. ``'a list of integers or null'``."""
        name = f"a list of {_ITEM_NAMES[self.item]}" if self.base is list else _TYPE_NAMES[self.base]
        return name + (" or null" if self.optional else "")

    @property
    def range_text(self) -> str | None:
        """Accepted range in words, e.g. ``'in [0, 1)'`` or ``'> 0'``; None if unbounded."""
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if lo and hi:
            return f"in {lo[0]}{_fmt(lo[1])}, {_fmt(hi[1])}{hi[0]}"
        if lo:
            return (">= " if lo[0] == "[" else "> ") + _fmt(lo[1])
        if hi:
            return ("<= " if hi[0] == "]" else "< ") + _fmt(hi[1])
        return None

    def in_range(self, x: float) -> bool:
        """Whether number ``x`` satisfies the bounds (NaN never does if any bound is set)."""
        return not (
            (self.ge is not None and not x >= self.ge)
            or (self.gt is not None and not x > self.gt)
            or (self.le is not None and not x <= self.le)
            or (self.lt is not None and not x < self.lt)
        )


def _fmt(x: float) -> str:
    return repr(x) if isinstance(x, int) else f"{x:g}"


_DATASETS = ("digits", "mnist", "fashionmnist", "cifar10", "cifar100", "svhn", "stl10",
             "imagefolder", "hdf5", "synthetic")
_TABULAR = ("tabular", "breast_cancer", "wine")
#: ``pkg.module:attr``, a Python object named by import path (:mod:`fedmpi.imports`).
IMPORT_PATTERN = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_IMPORT: dict[str, Any] = dict(pattern=IMPORT_PATTERN, pattern_help="pkg.module:attr")
_MEDMNIST: dict[str, Any] = dict(pattern=r"medmnist:\S+", pattern_help="medmnist:<flag>")
_DATASET_PATTERN: dict[str, Any] = dict(pattern=f"medmnist:\\S+|{IMPORT_PATTERN}",
                        pattern_help="medmnist:<flag> or pkg.module:attr")
#: ``eval.metrics`` names (:mod:`fedmpi.metrics`).
METRIC_NAMES = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")


def _live_names(registry: str) -> tuple[str, ...]:
    """Names registered now in the method, weighting or rule registry."""
    if registry == "algorithm":
        return tuple(_registry())
    if registry == "rule":
        from .algorithms.rules import RULES

        return tuple(RULES)
    from .algorithms import WEIGHTINGS

    return tuple(WEIGHTINGS)


def _registry():
    """The built-in methods (:mod:`fedmpi.algorithms`): their names and parameter blocks."""
    from .algorithms import ALGORITHMS

    return ALGORITHMS


_ALGORITHMS = tuple(_registry())

#: Methods that train submodels of resource levels (need ``system.levels``, exclude ECGR).
SUBMODEL_METHODS = ("fedlagc", "heterofl", "fedrolex", "fiarse", "scalefl")

#: Every config key, in the order :meth:`Config.to_dict` writes them.
SCHEMA: dict[str, Field] = {
    "name": Field(str, "quickstart", "run name; output goes to runtime.out_dir/<name>/",
                  pattern=r"(?!\.\.?$)[^/\\\x00-\x1f\x7f]+",
                  pattern_help="a non-empty name without '/' or control characters"),
    "seed": Field(int, 0, "master seed: sampling, client RNG streams, surrogate data", ge=0,
                  lt=2**63),
    # data
    "data.dataset": Field(str, "digits", "dataset name, or pkg.module:fn returning a Dataset or "
                          "(train, test) map-style datasets", choices=_DATASETS + _TABULAR,
                          **_DATASET_PATTERN),
    "data.root": Field(str, "./data", "directory holding (or receiving) dataset files"),
    "data.download": Field(bool, False, "download torchvision datasets if missing"),
    "data.num_clients": Field(int, 10, "number of logical clients (silos)", ge=1),
    "data.augment": Field(bool, False, "random crop + flip on 32x32 RGB datasets"),
    "data.image_size": Field(int, 32, "imagefolder: side images are resized/cropped to", ge=1),
    "data.partition.method": Field(str, "dirichlet", "how the training pool is split",
                                   choices=("iid", "dirichlet", "shards", "file", "silos")),
    "data.partition.alpha": Field(float, 0.5, "Dirichlet concentration", gt=0),
    "data.partition.classes_per_client": Field(int, 2, "classes per client (shards)", ge=1),
    "data.partition.min_size": Field(int, 10, "minimum samples per client", ge=0),
    "data.partition.file": Field(str | None, None, "JSON partition file (method: file)", file=True),
    "data.partition.seed": Field(int | None, None, "partition seed; null = top-level seed", ge=0,
                                 lt=2**63),
    # silo-local data (fedmpi/data/silos.py): each rank reads only the silos it hosts
    "data.silos.path": Field(str | None, None, "silos: per-client file template with {client} "
                             "(.csv/.parquet: feature columns + data.tabular.label; .h5: x, y)"),
    "data.silos.loader": Field(str | None, None, "silos: pkg.module:fn called as fn(client) -> "
                               "(x, y) on the rank hosting the client", **_IMPORT),
    "data.silos.test": Field(str | None, None, "silos: test-set file, read by rank 0 only",
                             file=True),
    "data.silos.validation": Field(str | None, None, "silos: server validation file (FedVG), read "
                                   "by rank 0 only; null = none", file=True),
    "data.silos.client_test": Field(str | None, None, "silos: per-client held-out test file "
                                    "template with {client}, read by the rank hosting the client "
                                    "(eval.where: clients | both); null = eval.client_holdout"),
    "data.silos.split": Field(str, "dirichlet", "how `fedmpi partition --export` splits "
                              "data.dataset into the silo files", choices=("iid", "dirichlet", "shards")),
    # tabular files (fedmpi/data/tabular.py)
    "data.tabular.train": Field(str | None, None, "dataset tabular: training-pool file "
                                "(.csv/.parquet/.h5)", file=True),
    "data.tabular.test": Field(str | None, None, "dataset tabular: test file", file=True),
    "data.tabular.label": Field(str, "label", "label column of CSV/Parquet files"),
    "data.validation.fraction": Field(float, 0.1, "server hold-out share of the pool (0 = none)",
                                      ge=0, lt=1),
    "data.validation.source": Field(str, "holdout", "'holdout' or an external dataset name",
                                    choices=("holdout",) + _DATASETS, **_MEDMNIST),
    "data.validation.per_class": Field(int | None, None, "external source: samples per target "
                                       "class; null = paper count (stl10 550, cifar100 1200)", ge=1),
    "data.validation.size_fraction": Field(float, 1.0, "keep this stratified share of the FedVG "
                                           "validation set (FedVG A.7.1)", gt=0, le=1),
    "data.validation.rho": Field(float | None, None, "class imbalance rho of the FedVG validation "
                                 "set (Eqs. E.8-E.9); null = off", gt=0, le=1),
    # model
    "model.name": Field(str, "cnn", "architecture, or pkg.module:fn (input_shape, num_classes) "
                        "-> nn.Module", choices=("lenet", "cnn", "resnet18", "resnet34", "resnet50",
                                                  "vit_s16", "vit_b16", "mlp"), **_IMPORT),
    "model.mlp.hidden": Field(list[int], [64, 64], "mlp: hidden layer widths", ge=1),
    "model.norm": Field(str, "bn", "normalisation layers", choices=("bn", "static_bn", "gn")),
    # train (client side)
    "train.rounds": Field(int, 30, "communication rounds", ge=1),
    "train.clients_per_round": Field(int | None, None, "participants per round; null = all",
                                     ge=1),
    "train.local_epochs": Field(int, 1, "local epochs per round", ge=1),
    "train.local_steps": Field(int | None, None, "local steps per round; overrides epochs",
                               ge=1),
    "train.batch_size": Field(int, 32, "client batch size", ge=1),
    "train.lr": Field(float, 0.05, "client learning rate", gt=0),
    "train.momentum": Field(float, 0.0, "client SGD momentum", ge=0, lt=1),
    "train.weight_decay": Field(float, 0.0, "client weight decay", ge=0),
    "train.optimizer": Field(str, "sgd", "client optimizer (state reset every client-round); "
                             "fednova, scaffold and ECGR assume sgd",
                             choices=("sgd", "adam", "adamw")),
    "train.betas": Field(list[float], [0.9, 0.999], "adam/adamw: (beta1, beta2)", ge=0, lt=1),
    "train.eps": Field(float, 1e-8, "adam/adamw: epsilon of the denominator", gt=0),
    "train.loss": Field(str, "cross_entropy", "client training loss (evaluation's test_loss is "
                        "always cross-entropy)", choices=("cross_entropy", "bce_logits")),
    "train.class_weights": Field(list[float] | None, None, "loss weight per class (C entries); "
                                 "null = equal", ge=0),
    "train.label_smoothing": Field(float, 0.0, "label smoothing eps: target (1 - eps) one-hot "
                                   "+ eps / C", ge=0, lt=1),
    "train.early_stopping.metric": Field(str | None, None, "stop when this /rounds metric "
                                         "(e.g. test_accuracy, test_loss, auroc) stops improving; "
                                         "null = off"),
    "train.early_stopping.mode": Field(str, "max", "max: higher is better; min: lower",
                                       choices=("max", "min")),
    "train.early_stopping.patience": Field(int, 5, "evaluated rounds without improvement "
                                           "before stopping", ge=1),
    "train.early_stopping.min_delta": Field(float, 0.0, "an improvement is a change beyond this",
                                            ge=0),
    "train.grad_clip": Field(float | None, None, "max gradient norm; null = no clipping", gt=0),
    "train.lr_decay": Field(float, 1.0, "step decay: round t uses lr * lr_decay^floor(t / "
                            "lr_decay_every) (ECGR paper: 0.5 every 10 rounds)", gt=0, le=1),
    "train.lr_decay_every": Field(int, 0, "rounds per lr_decay step; 0 = constant lr", ge=0),
    # algorithm (server rule and method parameters)
    "algorithm.name": Field(str, "fedavg", "federated method, or pkg.module:Class (a subclass "
                            "of fedmpi.algorithms.Algorithm)", choices=_ALGORITHMS, **_IMPORT,
                            registry="algorithm"),
    "algorithm.params": Field(dict, {}, "parameters of a user method (pkg.module:Class), checked "
                              "against its params['params'] dataclass"),
    "algorithm.server_lr": Field(float | None, None, "server learning rate; null = method default "
                                 "(1; fedadam/fedyogi 0.01)", gt=0),
    # method blocks algorithm.<method>.*: generated from the methods' parameter dataclasses
    # (_method_fields, fedmpi.params)
    # aggregation weights
    "aggregation.weighting": Field(str, "samples", "client weights in the server average, or "
                                   "pkg.module:Class (a Weighting subclass)",
                                   choices=("samples", "uniform", "fedvg", "fedvg_avg"), **_IMPORT,
                                   registry="weighting"),
    "aggregation.rule": Field(str, "mean", "server-side aggregation rule (fedmpi.algorithms.rules), "
                              "or pkg.module:Class (a ServerRule subclass); robust rules: "
                              "docs/robust-aggregation.md",
                              choices=("mean", "median", "trimmed_mean", "krum", "multi_krum",
                                       "geometric_median", "norm_clip", "fltrust"),
                              **_IMPORT, registry="rule"),
    "aggregation.params": Field(dict, {}, "parameters of a user rule (pkg.module:Class), checked "
                                "against its params['params'] dataclass"),
    "aggregation.fedvg.norm": Field(str, "l1", "FedVG gradient norm",
                                    choices=("l1", "l2", "spectral", "delta")),
    "aggregation.fedvg.granularity": Field(str, "model", "FedVG weight per model/layer/block",
                                           choices=("model", "layer", "block")),
    "aggregation.fedvg.eps": Field(float, 1e-8, "FedVG epsilon in 1/(G + eps)", gt=0),
    "aggregation.fedvg.batch_size": Field(int, 512, "FedVG scoring batch size", ge=1),
    "aggregation.fedvg.bf16": Field(bool, False, "FedVG scoring under bf16 autocast (CUDA only)"),
    "aggregation.fedvg.spectral_1d": Field(str, "exclude", "FedVG spectral norm: 1-D tensors "
                                           "left out of G_k (A.7.2) or scored with l2",
                                           choices=("exclude", "l2")),
    # ECGR
    "ecgr.enabled": Field(bool, False, "rewrite client updates with ECGR"),
    "ecgr.beta": Field(float, 0.2, "ECGR damping", ge=0, le=1),
    "ecgr.memory_budget": Field(int, 1 << 30, "ECGR memory budget in bytes", ge=0),
    # system heterogeneity (FedLAGC, HeteroFL, ...)
    "system.levels": Field(list[float] | None, None, "resource levels r in (0, 1]", gt=0, le=1),
    "system.allocation": Field(list[int] | None, None, "clients per resource level", ge=0),
    # adversaries
    # user update transforms (fedmpi/algorithms/transforms.py), after ECGR and the adversary
    "transforms": Field(list[str], [], "update transforms by import path (pkg.module:Class, "
                        "a subclass of fedmpi.algorithms.UpdateTransform built with the config), "
                        "applied in this order around any method", **_IMPORT),
    "adversary.clients": Field(list[int], [], "ids of misbehaving clients"),
    "adversary.kind": Field(str, "nan", "attack type (crash: local training raises, to exercise "
                            "the failure path; gaussian and alie: docs/robust-aggregation.md)",
                            choices=("nan", "scale", "sign_flip", "label_flip", "crash",
                                     "gaussian", "alie")),
    "adversary.factor": Field(float, 10.0, "attack strength (scale factor)"),
    "adversary.alie_z": Field(float | None, None, "alie: the shift z of mu - z*sigma (null: the "
                              "paper's z_max from the participants and attackers)"),
    # privacy (fedmpi/privacy): differential privacy with a dp-accounting accountant
    "privacy.dp.level": Field(str, "none", "differential privacy: client = DP-FedAvg (each client's "
                              "update clipped, Gaussian noise on the sum), record = DP-SGD inside "
                              "each silo (per-sample clipping, Poisson batches)",
                              choices=("none", "client", "record")),
    "privacy.dp.noise": Field(str, "central", "client level: who adds the noise std sigma*C to the "
                              "sum: rank 0 (central) or every participant a share (distributed)",
                              choices=("central", "distributed")),
    "privacy.dp.noise_multiplier": Field(float, 1.0, "sigma: noise std / clip norm (0 = clipping "
                                         "only, epsilon infinite)", ge=0),
    "privacy.dp.clip": Field(float, 1.0, "C: l2 clip norm of a client's update (client) or of a "
                             "sample's gradient (record)", gt=0),
    "privacy.dp.delta": Field(float, 1e-5, "delta at which epsilon is reported", gt=0, lt=1),
    "privacy.dp.accountant": Field(str, "rdp", "dp-accounting accountant: rdp (Renyi DP) or pld "
                                   "(privacy loss distributions; not for fixed-size client "
                                   "sampling)", choices=("rdp", "pld")),
    "privacy.target_epsilon": Field(float | None, None, "stop the run (status completed) before "
                                    "the next round would take epsilon above this; null = no "
                                    "budget", gt=0),
    "privacy.secure_aggregation": Field(bool, False, "pairwise-masked secure aggregation: rank 0 "
                                        "only holds sums over the accepted clients (extra "
                                        ".[privacy])"),
    "privacy.secagg.scale_bits": Field(int, 24, "fixed-point fractional bits f of secure "
                                       "aggregation (ring 2^48: |sum| < 2^(47-f))", ge=8, le=40),
    # evaluation
    "eval.every": Field(int, 1, "evaluate every N rounds", ge=1),
    "eval.batch_size": Field(int, 1024, "evaluation batch size", ge=1),
    "eval.metrics": Field(list[str], ["accuracy"], "test metrics logged as /rounds/<metric> "
                          "(accuracy is test_accuracy), or pkg.module:fn(labels, probabilities) "
                          "-> float logged as /rounds/fn; auroc and user metrics evaluate on "
                          "rank 0 only", choices=METRIC_NAMES, **_IMPORT),
    "eval.where": Field(str, "server", "who evaluates the global model: server = rank 0 on "
                        "the test set; clients = every client on its own held-out data (rank 0 "
                        "reads no test file); both", choices=("server", "clients", "both")),
    "eval.client_holdout": Field(float | None, None, "eval.where clients | both: share of each "
                                 "client's samples held out for its evaluation (fixed by seed, "
                                 "removed from training), unless data.silos.client_test names "
                                 "files", gt=0, lt=1),
    "eval.overlap": Field(bool, True, "rank 0 evaluates round t's model while the workers train "
                          "round t+1 (world_size > 1, not sharded); round t's log row is "
                          "written then"),
    "eval.sharded": Field(bool, False, "every rank evaluates a slice of the test set (one extra "
                          "state Bcast per evaluation round); rank 0 alone when false"),
    # best model (fedmpi/callbacks.py)
    "checkpoint.keep_best.metric": Field(str | None, None, "write best.pt beside model.pt for "
                                         "the round that is best in this /rounds metric; null = "
                                         "off"),
    "checkpoint.keep_best.mode": Field(str, "max", "max: higher is better; min: lower",
                                       choices=("max", "min")),
    # experiment trackers (fedmpi/trackers.py): live views of the HDF5 log, from rank 0
    "logging.tensorboard": Field(str | None, None, "TensorBoard event directory written per "
                                 "round (extra fedmpi[tensorboard]); null = off"),
    "logging.mlflow.tracking_uri": Field(str | None, None, "MLflow tracking URI (e.g. "
                                         "file:/path/mlruns) logged per round (extra "
                                         "fedmpi[mlflow]); null = off"),
    "logging.mlflow.experiment": Field(str, "fedmpi", "MLflow experiment name"),
    # runtime
    "runtime.device": Field(str, "auto", "torch device", choices=("auto", "cpu"),
                            pattern=r"cuda(:\d+)?", pattern_help="cuda[:N]"),
    "runtime.out_dir": Field(str, "runs", "parent directory of run outputs"),
    "runtime.checkpoint_every": Field(int, 0, "checkpoint every N rounds (0 = only at exit)",
                                      ge=0),
    "runtime.round_timeout": Field(float, 600.0, "abort if a round takes longer (seconds)", gt=0),
    "runtime.progress": Field(bool, True, "show a progress bar"),
    "runtime.reduction": Field(str, "default", "how the uplink sums reach rank 0: default = "
                               "summed on each worker, then over ranks (equal across world sizes "
                               "up to float rounding); exact = one row per client, summed in "
                               "client-id order on rank 0 (bit-identical for every world size "
                               "and rank layout at pinned runtime.threads; evaluation not "
                               "sharded)", choices=("default", "exact")),
    "runtime.threads": Field(int | None, None, "torch threads per rank; null = torch default",
                             ge=1),
    "runtime.autocast": Field(str, "off", "forward pass under torch.autocast (bf16: parameters, "
                              "updates and aggregation stay float32); for GPU runs",
                              choices=("off", "bf16")),
    "runtime.channels_last": Field(bool, False, "feed image batches channels-last (NHWC) to the "
                                   "model; for GPU convolutions"),
    "runtime.deterministic": Field(bool, False, "deterministic GPU kernels, no TF32 (bit-"
                                   "reproducible CUDA runs; slower)"),
    "runtime.compile": Field(bool, False, "wrap the model's forward in torch.compile"),
    "runtime.compile_mode": Field(str, "default", "torch.compile mode (reduce-overhead = CUDA "
                                  "graphs)", choices=("default", "reduce-overhead", "max-autotune",
                                                      "max-autotune-no-cudagraphs")),
}



def _method_fields() -> dict[str, Field]:
    """``algorithm.<group>.*`` keys from the methods' parameter dataclasses (:mod:`fedmpi.params`)."""
    from .params import group_fields

    out: dict[str, Field] = {}
    for cls in _registry().values():
        for group, params_cls in cls.params.items():
            if group == "params":   # a user method's free-form block (fedmpi.imports)
                continue
            for name, tp, default, meta in group_fields(params_cls):
                key = f"algorithm.{group}.{name}"
                if key not in out:
                    out[key] = Field(tp, default, meta["help"], choices=meta["choices"],
                                     ge=meta["ge"], gt=meta["gt"], le=meta["le"], lt=meta["lt"])
                    if meta["renamed_from"]:
                        _RENAMED.setdefault(meta["renamed_from"], []).append(key)
    return out


#: flat keys of earlier versions → their nested names (one per method that has the field)
_RENAMED: dict[str, list[str]] = {}


def renamed_to(old_key: str) -> list[str]:
    """The nested keys a flat key of earlier versions became (e.g. ``algorithm.mu`` →
    ``["algorithm.fedprox.mu"]``); empty for a current key. For reading old logs."""
    return list(_RENAMED.get(old_key, ()))


def _rule_fields() -> dict[str, Field]:
    """``aggregation.<rule>.*`` keys from the server rules' parameter dataclasses."""
    from .algorithms.rules import RULES
    from .params import group_fields

    out: dict[str, Field] = {}
    for cls in RULES.values():
        for group, params_cls in cls.params.items():
            for name, tp, default, meta in group_fields(params_cls):
                out.setdefault(f"aggregation.{group}.{name}",
                               Field(tp, default, meta["help"], choices=meta["choices"],
                                     ge=meta["ge"], gt=meta["gt"], le=meta["le"], lt=meta["lt"]))
    return out


def _with_method_fields(schema: dict[str, Field]) -> dict[str, Field]:
    keys = list(schema)
    at = keys.index("algorithm.server_lr") + 1
    methods = _method_fields()
    out = {**{k: schema[k] for k in keys[:at]}, **methods, **{k: schema[k] for k in keys[at:]}}
    keys = list(out)
    at = keys.index("aggregation.params") + 1
    return {**{k: out[k] for k in keys[:at]}, **_rule_fields(), **{k: out[k] for k in keys[at:]}}


SCHEMA = _with_method_fields(SCHEMA)


def _sections() -> set[str]:
    """Dotted names of every section (``"data"``, ``"data.partition"``, ...)."""
    return {key.rsplit(".", i)[0] for key in SCHEMA for i in range(1, key.count(".") + 1)}


# --------------------------------------------------------------------------- #
# Per-field validation
# --------------------------------------------------------------------------- #
def _got(value: Any) -> str:
    return "got null" if value is None else f"got {value!r} ({type(value).__name__})"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _coerce_scalar(tp: type, x: Any) -> tuple[bool, Any]:
    """Return ``(ok, value)`` for scalar ``x`` against type ``tp`` (int -> float widening)."""
    if tp is float:
        # float(): a numpy float64 (a float subclass) is stored as a plain float
        return (_is_int(x) or isinstance(x, float)), (float(x) if _is_int(x) or isinstance(x, float)
                                                      else x)
    if tp is int:
        return _is_int(x), x
    return isinstance(x, tp), x


def _suggest(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


#: Largest float32: the model and its updates are float32, so a larger (or non-finite)
#: float key would turn the run into inf/NaN arithmetic (issue 18).
FLOAT32_MAX = 3.4028234663852886e38


def _check_finite(key: str, f: Field, x: Any, where: str = "") -> None:
    """Reject NaN, ±inf and floats beyond float32 range for a float key."""
    if isinstance(x, float) and not (math.isfinite(x) and abs(x) <= FLOAT32_MAX):
        bounds = f" {f.range_text}" if f.range_text else ""
        raise ConfigError(f"config key {key!r} must be a finite number{bounds} with |x| <= "
                          f"{FLOAT32_MAX:.4g} (float32){where}, got {x!r}")


def _check_value(key: str, f: Field, value: Any) -> Any:
    """Validate one value against its field; return it normalised (floats, tuples)."""
    if value is None:
        if f.optional:
            return None
        raise ConfigError(f"config key {key!r} expects {f.type_name}, got null")
    if f.base is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key {key!r} expects a mapping with string keys, "
                              f"{_got(value)}")
        return {k: value[k] for k in value}
    if f.base is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} expects {f.type_name}, {_got(value)}")
        items = []
        for i, x in enumerate(value):
            ok, x = _coerce_scalar(f.item, x)
            if not ok:
                raise ConfigError(f"config key {key!r} expects {f.type_name}; item {i} is "
                                  f"{'null' if x is None else f'{x!r} ({type(x).__name__})'}")
            if f.item is float:
                _check_finite(key, f, x, f"; item {i}")
            if f.item in (int, float) and not f.in_range(x):
                raise ConfigError(
                    f"config key {key!r} items must each be {f.range_text}; item {i} is {x!r}")
            matches = f.pattern is not None and isinstance(x, str) and \
                re.fullmatch(f.pattern, x) is not None
            if f.choices is not None and x not in f.choices and not matches:
                alt = f" or {f.pattern_help}" if f.pattern_help else ""
                raise ConfigError(f"config key {key!r} item {i} expects one of "
                                  f"{', '.join(f.choices)}{alt}, got {x!r}"
                                  f"{_suggest(x, f.choices)}")
            if f.choices is not None and x in items:
                raise ConfigError(f"config key {key!r} lists {x!r} twice")
            if f.choices is None and f.pattern is not None and not matches:
                raise ConfigError(f"config key {key!r} item {i} expects "
                                  f"{f.pattern_help or f.pattern}, got {x!r}")
            items.append(x)
        return tuple(items)
    ok, value = _coerce_scalar(f.base, value)
    if not ok:
        raise ConfigError(f"config key {key!r} expects {f.type_name}, {_got(value)}")
    if f.base is float:
        _check_finite(key, f, value)
    if f.base in (int, float) and not f.in_range(value):
        raise ConfigError(f"config key {key!r} must be {f.range_text}, got {value!r}")
    if f.choices is not None or f.pattern is not None:
        choices = _live_names(f.registry) if f.registry else f.choices
        if not ((choices and value in choices)
                or (f.pattern and re.fullmatch(f.pattern, value))):
            allowed = ", ".join(choices or ())
            if f.pattern:
                alt = f.pattern_help or f"a string matching {f.pattern}"
                allowed = f"{allowed} or {alt}" if allowed else alt
            hint = _suggest(value, choices) if choices else ""
            raise ConfigError(
                f"config key {key!r} expects one of {allowed}, got {value!r}{hint}"
                if choices else f"config key {key!r} expects {allowed}, got {value!r}")
    return value


# --------------------------------------------------------------------------- #
# Flattening sources into dotted keys
# --------------------------------------------------------------------------- #
def _unknown_key(key: str) -> ConfigError:
    hint = _suggest(key, list(SCHEMA) + sorted(_sections()))
    if not hint:  # e.g. 'lr' -> 'train.lr': same last component in some section
        last = key.rsplit(".", 1)[-1]
        same = [k for k in SCHEMA if k.rsplit(".", 1)[-1] == last]
        hint = f" (did you mean {same[0]!r}?)" if same else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Write the leaves of ``value`` (placed at dotted ``prefix``) into ``out``.

    ``prefix`` may be a leaf key, a section (then ``value`` must be a mapping,
    or null for an empty section) or ``""`` for the top level.
    """
    if prefix in SCHEMA or prefix in _RENAMED:
        out[prefix] = value
        return
    owner = _mapping_owner(prefix)
    if owner is not None:   # an entry of a free-form mapping: --set algorithm.params.width=8
        node = out[owner] = _deep_copy_mapping(out.get(owner) or {})
        *parents, leaf = prefix[len(owner) + 1:].split(".")
        for p in parents:
            child = _deep_copy_mapping(node[p]) if isinstance(node.get(p), Mapping) else {}
            node[p] = child
            node = child
        node[leaf] = value
        return
    if prefix and prefix not in _sections() and not (isinstance(value, Mapping) and value):
        raise _unknown_key(prefix)
    if value is None and prefix:
        return  # "train:" with every entry commented out
    if not isinstance(value, Mapping):
        where = f"config section {prefix!r}" if prefix else "the top level of the config"
        raise ConfigError(f"{where} expects a mapping of keys, {_got(value)}")
    for k, v in value.items():
        _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)


def _mapping_owner(key: str) -> str | None:
    """The ``dict`` field that ``key`` lies inside (``algorithm.params`` for
    ``algorithm.params.width``), or None."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        f = SCHEMA.get(".".join(parts[:i]))
        if f is not None:
            return ".".join(parts[:i]) if f.base is dict else None
    return None


def _deep_copy_mapping(m: Mapping) -> dict:
    return {k: _deep_copy_mapping(v) if isinstance(v, Mapping) else v for k, v in m.items()}


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-8`` / ``3E5`` as floats (YAML 1.2 style)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    """A mapping whose keys are unique: a repeated key is an error naming it, not
    a silent "last one wins" (merge keys ``<<`` may still be overridden)."""
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:
            continue   # unhashable: SafeLoader reports it below
        if first is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"duplicate key {key!r} (first given on line {first.line + 1})",
                key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: _yaml_map(loader, node))


def _yaml_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    data: dict[Any, Any] = {}
    yield data
    data.update(_construct_mapping(loader, node))


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_override(item: str, out: dict[str, Any]) -> None:
    """Apply one ``KEY=VALUE`` item (VALUE parsed as YAML) to the flat dict ``out``."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. train.lr=0.1), got {item!r}")
    key, text = (s.strip() for s in item.split("=", 1))
    if not key:
        raise ConfigError(f"--set expects KEY=VALUE with a non-empty dotted key, got {item!r}")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"cannot parse value {text!r} for config key {key!r}: {problem}") from None
    f = SCHEMA.get(key)
    if f is not None and f.base is str and value is not None and not isinstance(value, str):
        value = text  # command-line text for a string key is a string: name=2024 -> "2024"
    _flatten(key, value, out)


# --------------------------------------------------------------------------- #
# Config objects
# --------------------------------------------------------------------------- #
def _plain(value: Any) -> Any:
    """A caller's copy of a stored value: tuples as lists, mappings copied."""
    if isinstance(value, tuple):
        return list(value)
    return _deep_copy_mapping(value) if isinstance(value, Mapping) else value


class Section:
    """Read-only view of one section of a :class:`Config` (``cfg.data.partition``).

    Attribute access returns a leaf value or a nested :class:`Section`; list
    values come back as fresh lists.
    """

    def __init__(self, values: Mapping[str, Any], prefix: str = "") -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.get(name)
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("config objects are immutable; use Config.replace()")

    def __dir__(self) -> list[str]:
        start = self._prefix + "." if self._prefix else ""
        names = {k[len(start):].split(".")[0] for k in SCHEMA if k.startswith(start)}
        return sorted(set(super().__dir__()) | names)

    def get(self, dotted: str, default: Any = ...) -> Any:
        """Value (or :class:`Section`) at ``dotted``, relative to this section.

        Raises ``KeyError`` (with a suggestion) for an unknown key unless a
        ``default`` is given.
        """
        key = f"{self._prefix}.{dotted}" if self._prefix else dotted
        if key in SCHEMA:
            return _plain(self._values[key])
        if key in _sections():
            return Section(self._values, key)
        if default is not ...:
            return default
        raise KeyError(str(_unknown_key(key)))

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict of this section (lists as lists), in schema order."""
        out: dict[str, Any] = {}
        start = self._prefix + "." if self._prefix else ""
        for key, value in self._values.items():
            if not key.startswith(start):
                continue
            *parents, leaf = key[len(start):].split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = _plain(value)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Section):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._prefix or 'root'}: {self.to_dict()!r})"


class Config(Section):
    """A resolved, validated run configuration.

    Build one with :func:`load_config` or :func:`config_from_dict`. Access
    values as attributes (``cfg.train.lr``, ``cfg.data.partition.alpha``) or
    by dotted key (``cfg.get("train.lr")``).
    """

    def __init__(self, values: Mapping[str, Any], base_dir: str | os.PathLike | None = None):
        """Internal: ``values`` must already be complete and validated; see :func:`_build`."""
        super().__init__(dict(values))
        object.__setattr__(self, "_base_dir", base_dir)
        #: (old flat key, new nested key) pairs the sources used (see :mod:`fedmpi.params`)
        object.__setattr__(self, "renamed", [])

    def to_flat_dict(self) -> dict[str, Any]:
        """All values keyed by dotted name, in schema order."""
        return {k: _plain(v) for k, v in self._values.items()}

    def to_yaml(self) -> str:
        """The full config (defaults filled in) as YAML; loads back to an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **dotted_overrides: Any) -> Config:
        """A copy with some keys changed, revalidated: ``cfg.replace(**{"train.lr": 0.1})``."""
        given = {k: v for k, v in self._values.items()}
        for key, value in dotted_overrides.items():
            _flatten(key, value, given)
        return _build(given, self._base_dir)

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"


def _resolve_files(values: dict[str, Any], base_dir: str | os.PathLike | None) -> None:
    """Make ``file`` fields absolute: relative to ``base_dir`` if the file exists there, else CWD."""
    for key, f in SCHEMA.items():
        if f.file and values[key] is not None:
            path = Path(values[key]).expanduser()
            if not path.is_absolute():
                there = Path(base_dir) / path if base_dir is not None else None
                path = there if there is not None and there.exists() else Path.cwd() / path
            values[key] = str(path.resolve())


def _cross_checks(cfg: Config) -> None:
    """Rules that involve more than one key; raise ConfigError on the first violation."""
    n = cfg.data.num_clients
    k = cfg.train.clients_per_round
    if k is not None and k > n:
        raise ConfigError(
            f"config key 'train.clients_per_round' must be <= data.num_clients ({n}), got {k}")

    part = cfg.data.partition
    if part.method == "file":
        if part.file is None:
            raise ConfigError("config key 'data.partition.file' is required when "
                              "data.partition.method is 'file'")
        if not Path(part.file).is_file():
            raise ConfigError(f"config key 'data.partition.file': file not found: {part.file}")

    _data_checks(cfg)
    _train_checks(cfg)
    _eval_checks(cfg)

    levels, alloc = cfg.system.levels, cfg.system.allocation
    if (levels is None) != (alloc is None):
        missing, given = ("system.allocation", "system.levels") if alloc is None else \
            ("system.levels", "system.allocation")
        raise ConfigError(f"config key {missing!r} must be set when {given!r} is set "
                          "(one client count per resource level)")
    if levels is not None:
        if len(levels) != len(alloc):
            raise ConfigError(
                f"config key 'system.allocation' must have one entry per system.levels entry "
                f"({len(levels)}), got {len(alloc)}")
        if sum(alloc) != n:
            raise ConfigError(
                f"config key 'system.allocation' must sum to data.num_clients ({n}), "
                f"got {alloc} (sum {sum(alloc)})")

    for c in cfg.adversary.clients:
        if not 0 <= c < n:
            raise ConfigError(f"config key 'adversary.clients' has client id {c} outside "
                              f"[0, {n}) (data.num_clients = {n})")
    if len(set(cfg.adversary.clients)) != len(cfg.adversary.clients):
        raise ConfigError(f"config key 'adversary.clients' lists a client twice: "
                          f"{cfg.adversary.clients}")

    steps = cfg.train.local_steps
    if cfg.ecgr.enabled and steps is not None and steps < 2:
        raise ConfigError(f"config key 'train.local_steps' must be >= 2 when ecgr.enabled is true "
                          f"(ECGR selects half of the local steps), got {steps}")

    if cfg.algorithm.name in SUBMODEL_METHODS:
        if levels is None:
            raise ConfigError(f"config key 'system.levels' must be set for algorithm.name "
                              f"{cfg.algorithm.name!r} (with system.allocation, e.g. levels "
                              "[1, 0.25] and allocation [5, 5])")
        if cfg.ecgr.enabled:
            raise ConfigError(f"config key 'ecgr.enabled': ECGR does not compose with "
                              f"algorithm.name={cfg.algorithm.name!r} (submodel uploads are masked)")
    gps = cfg.algorithm.fedgps
    if cfg.algorithm.name == "fedgps" and not (gps.static or gps.dynamic):
        raise ConfigError("config keys 'algorithm.fedgps.static' and 'algorithm.fedgps.dynamic' "
                          "are both false: that is FedAvg (use algorithm.name=fedavg)")

    if cfg.aggregation.fedvg.bf16 and cfg.runtime.device == "cpu":
        raise ConfigError("config key 'aggregation.fedvg.bf16' needs a CUDA scoring device "
                          "(runtime.device is 'cpu')")

    _privacy_checks(cfg)

    agg, val = cfg.aggregation, cfg.data.validation
    if (agg.weighting in ("fedvg", "fedvg_avg") and agg.fedvg.norm != "delta"
            and part.method == "silos" and val.source == "holdout"
            and cfg.data.silos.validation is None):
        raise ConfigError(
            f"config key 'data.silos.validation' must name the server validation file for "
            f"aggregation.weighting {agg.weighting!r} (FedVG scores on it) with silo-local data")
    if (agg.weighting in ("fedvg", "fedvg_avg") and agg.fedvg.norm != "delta"
            and part.method != "silos" and val.source == "holdout" and val.fraction == 0):
        raise ConfigError(
            f"config key 'data.validation.fraction' must be > 0 for aggregation.weighting "
            f"{agg.weighting!r} (FedVG scores on a server validation set), or set "
            "data.validation.source to an external dataset")


def _privacy_checks(cfg: Config) -> None:
    """``privacy.*`` against the rest (docs/privacy.md says why each pair is refused)."""
    p = cfg.privacy
    level = p.dp.level
    if level == "none":
        if p.target_epsilon is not None:
            raise ConfigError("config key 'privacy.target_epsilon' needs privacy.dp.level client or "
                              "record (privacy.dp.level is 'none': no epsilon to budget)")
        return
    t = cfg.train
    if level == "record" and (t.loss != "cross_entropy" or t.class_weights is not None
                              or t.label_smoothing != 0.0):
        raise ConfigError("config key 'train.loss' (with train.class_weights, "
                          "train.label_smoothing) must be the plain cross_entropy with "
                          "privacy.dp.level 'record' (DP-SGD clips per-sample cross-entropy "
                          "gradients)")
    if level == "client" and cfg.aggregation.weighting != "uniform":
        raise ConfigError(f"config key 'aggregation.weighting' must be 'uniform' with "
                          f"privacy.dp.level 'client' (DP-FedAvg's fixed-denominator mean), got "
                          f"{cfg.aggregation.weighting!r}")
    if level == "client" and cfg.aggregation.rule != "mean":
        raise ConfigError(f"config key 'aggregation.rule' must be 'mean' with privacy.dp.level "
                          f"'client' (the noise is calibrated to the mean of clipped updates), got "
                          f"{cfg.aggregation.rule!r}")
    m = cfg.train.clients_per_round or cfg.data.num_clients
    if level == "client" and p.dp.accountant == "pld" and m < cfg.data.num_clients:
        raise ConfigError("config key 'privacy.dp.accountant': 'pld' has no fixed-size (without "
                          "replacement) sampling; use 'rdp' with train.clients_per_round "
                          f"{m} < data.num_clients {cfg.data.num_clients}")


def _resolve_renamed(given: dict[str, Any]) -> list[tuple[str, str]]:
    """Move values given under an old flat key to the new nested key of the chosen
    method (``algorithm.mu`` → ``algorithm.fedprox.mu``); returns (old, new) pairs."""
    moved = []
    method = given.get("algorithm.name", SCHEMA["algorithm.name"].default)
    for old in [k for k in given if k in _RENAMED]:
        targets = _RENAMED[old]
        new = next((t for t in targets if t.split(".")[1] == method), targets[0])
        if new in given:
            raise ConfigError(f"config key {old!r} is the old name of {new!r}; give only {new!r}")
        given[new] = given.pop(old)
        moved.append((old, new))
    return moved


def _data_checks(cfg: Config) -> None:
    """Silo-local data and tabular files: the keys each mode needs."""
    d = cfg.data
    if d.partition.method == "silos":
        s = d.silos
        if (s.path is None) == (s.loader is None):
            raise ConfigError("config key 'data.silos.path' or 'data.silos.loader' (exactly one) "
                              "must be set when data.partition.method is 'silos'")
        if s.path is not None and not _client_template(s.path):
            raise ConfigError(f"config key 'data.silos.path' must be a file template with "
                              f"{{client}} as its only field, e.g. silos/{{client}}.csv; got "
                              f"{s.path!r}")
        if s.test is None and cfg.eval.where != "clients":
            raise ConfigError("config key 'data.silos.test' is required when "
                              "data.partition.method is 'silos' (rank 0 reads the test set), "
                              "unless eval.where is 'clients'")
        if cfg.eval.sharded:
            raise ConfigError("config key 'eval.sharded' must be false when data.partition.method "
                              "is 'silos' (rank 0 alone holds the test set)")
    if d.dataset == "tabular":
        for key in ("train", "test"):
            if d.tabular.get(key) is None:
                raise ConfigError(f"config key 'data.tabular.{key}' is required when "
                                  "data.dataset is 'tabular'")


def _client_template(path: str) -> bool:
    """Whether ``path`` is a file template whose only field is ``{client}``."""
    try:
        return path.format(client=0) != path.format(client=1)
    except (KeyError, IndexError, ValueError):
        return False


def _train_checks(cfg: Config) -> None:
    """Optimizer and loss keys that only make sense together."""
    t = cfg.train
    if len(t.betas) != 2:
        raise ConfigError(f"config key 'train.betas' expects two numbers (beta1, beta2), got "
                          f"{t.betas}")
    if t.optimizer != "sgd" and t.momentum:
        raise ConfigError(f"config key 'train.momentum' is SGD's; with train.optimizer "
                          f"{t.optimizer!r} set train.betas instead (momentum must be 0)")
    if cfg.ecgr.enabled and t.optimizer != "sgd":
        raise ConfigError(f"config keys 'ecgr.enabled' and 'train.optimizer': ECGR rewrites "
                          f"SGD steps (its math assumes sgd), got train.optimizer "
                          f"{t.optimizer!r}")


def _metric_names(cfg: Config) -> list[str]:
    """The ``/rounds`` metrics early stopping and the best model may follow."""
    from .metrics import extra_names

    own = ["test_loss", "test_accuracy", *extra_names(cfg.eval.metrics)]
    sites = [f"clients_{m}" for m in own] if cfg.eval.where == "both" else []
    return [*own, "train_loss", *sites]


def _eval_checks(cfg: Config) -> None:
    """Where evaluation happens, user metric names, the metrics followed by early stopping
    and the best model."""
    from .metrics import RESERVED, is_user_metric, metric_name

    e, s = cfg.eval, cfg.data.silos
    names = [metric_name(m) for m in e.metrics if is_user_metric(m)]
    for m in e.metrics:
        name = metric_name(m)
        if is_user_metric(m) and (name in RESERVED or names.count(name) > 1):
            raise ConfigError(f"config key 'eval.metrics': {m!r} would be logged as {name!r}, "
                              "which another metric already uses")
    if s.client_test is not None:
        if cfg.data.partition.method != "silos":
            raise ConfigError("config key 'data.silos.client_test' needs data.partition.method "
                              "'silos' (with pooled data use eval.client_holdout)")
        if not _client_template(s.client_test):
            raise ConfigError(f"config key 'data.silos.client_test' must be a file template "
                              f"with {{client}} as its only field, got {s.client_test!r}")
    if e.where != "server":
        if s.client_test is None and e.client_holdout is None:
            raise ConfigError(f"config key 'eval.client_holdout' (a share such as 0.2) or "
                              f"'data.silos.client_test' must be set when eval.where is "
                              f"{e.where!r}: each client evaluates on data it does not train on")
        if cfg.algorithm.name in SUBMODEL_METHODS:
            raise ConfigError(f"config key 'eval.where' must be 'server' for algorithm.name "
                              f"{cfg.algorithm.name!r} (the method evaluates its resource levels "
                              "itself)")
        if e.sharded:
            raise ConfigError(f"config key 'eval.sharded' must be false when eval.where is "
                              f"{e.where!r} (the clients evaluate their own data)")
    allowed = _metric_names(cfg)
    for key in ("train.early_stopping.metric", "checkpoint.keep_best.metric"):
        metric = cfg.get(key)
        if metric is not None and metric not in allowed:
            raise ConfigError(f"config key {key!r} must name a logged metric, one of "
                              f"{', '.join(allowed)}; got {metric!r}{_suggest(metric, allowed)}")


def _build(given: Mapping[str, Any], base_dir: str | os.PathLike | None) -> Config:
    """Fill defaults, validate every field, resolve file paths, run cross-checks."""
    given = dict(given)
    renamed = _resolve_renamed(given)
    values = {key: _check_value(key, f, given[key]) if key in given else
              _check_value(key, f, f.default) for key, f in SCHEMA.items()}
    _resolve_files(values, base_dir)
    cfg = Config(values, base_dir)
    object.__setattr__(cfg, "renamed", renamed)
    _cross_checks(cfg)
    return cfg


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #
def config_from_dict(d: Mapping[str, Any] | None, overrides: Sequence[str] = (),
                     base_dir: str | os.PathLike | None = None) -> Config:
    """Build a :class:`Config` from a nested dict plus ``KEY=VALUE`` overrides.

    Args:
        d: nested mapping as read from YAML (``{"train": {"lr": 0.1}}``);
            None or ``{}`` gives all defaults.
        overrides: ``"train.lr=0.1"``-style items, applied after ``d``.
        base_dir: directory against which relative file paths are tried first.
    """
    given: dict[str, Any] = {}
    _flatten("", {} if d is None else d, given)
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        _parse_override(item, given)
    return _build(given, base_dir)


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (),
                base_dir: str | os.PathLike | None = None) -> Config:
    """Load a YAML config file, apply ``--set`` overrides and validate.

    Args:
        path: YAML file, or None for all defaults.
        overrides: ``"KEY=VALUE"`` items; VALUE is parsed as YAML
            (``"adversary.clients=[1,2]"``, ``"train.clients_per_round=null"``).
        base_dir: where relative file paths in the config are looked up first;
            defaults to the config file's directory.
    """
    data: Any = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(f"cannot read config file {path}: {reason}") from None
        try:
            data = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ConfigError(f"invalid YAML in config file {path}{where}: {problem}") from None
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must contain a mapping of keys at the top "
                              f"level, {_got(data)}")
        if base_dir is None:
            base_dir = path.parent
    return config_from_dict(data, overrides, base_dir)


def _check_schema() -> None:
    """Import-time sanity check: defaults are valid and no key shadows a Config method."""
    for key, f in SCHEMA.items():
        _check_value(key, f, f.default)
        for part in key.split("."):
            if hasattr(Config, part) or not part.isidentifier():
                raise TypeError(f"config key {key!r}: {part!r} is not usable as an attribute")


_check_schema()


def _describe(field: Field) -> str:
    """Allowed values of ``field`` in words (for the reference table)."""
    parts = []
    if field.choices:
        parts.append(" \\| ".join(f"`{c}`" for c in field.choices))
    if field.pattern_help:
        parts.append(f"`{field.pattern_help}`")
    for op, bound in (("≥", field.ge), (">", field.gt), ("≤", field.le), ("<", field.lt)):
        if bound is not None:
            parts.append(f"{op} {bound:g}")
    return ", ".join(parts)


def reference_markdown() -> str:
    """The config reference table of docs/configuration.md, generated from :data:`SCHEMA`.

    Regenerate that section with
    ``python -c "from fedmpi.config import reference_markdown as r; print(r())"``.
    """
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, spec in SCHEMA.items():
        type_name = (str(spec.type).replace("typing.", "").replace("<class '", "").replace("'>", "")
                     .replace(" | ", " or "))
        default = "null" if spec.default is None else yaml.safe_dump(spec.default, default_flow_style=True).strip()
        default = default.removesuffix("\n...").removesuffix("...").strip()
        rows.append(f"| `{key}` | {type_name} | `{default}` | {_describe(spec)} | "
                    f"{spec.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
