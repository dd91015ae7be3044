"""The framework's own config keys, as typed sections, and their cross-key rules.

:class:`FrameworkConfig` declares every key that is not a component's parameter, one
frozen dataclass per section in the components' style (:func:`~fedmpi.config.params.param`):
run name and seed, ``data.*``, ``model.*``, ``train.*``, the component selectors
``algorithm.name``, ``aggregation.weighting``, ``aggregation.rule``, ``transforms``,
``system.*``, ``privacy.*``, ``eval.*``, ``checkpoint.*``, ``logging.*`` and ``runtime.*``.
A :class:`~fedmpi.config.core.Config` has these sections as typed attributes
(``cfg.train``: :class:`TrainConfig`), so ``mypy`` checks every read of a framework key;
:data:`FRAMEWORK` is the same keys flattened (dotted key → Field).
:func:`framework_checks` holds the rules that involve more than one of them (data,
sampling, resource levels, privacy, evaluation metrics). :mod:`fedmpi.config.schema`
assembles the run's schema from these and the parameter blocks and rules of the registered
components; no component is named or imported here: the component selectors' defaults and
choices come from the registries it hands to :func:`with_components`. Over ~550 lines because it is one table: every
framework key with its type, default, range and help, next to the rules that relate them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmpi.config.core import Config
from fedmpi.config.fields import Field, suggest
from fedmpi.config.params import CopyOnRead, param, section, section_fields
from fedmpi.config.rounds import RoundConfig, round_checks
from fedmpi.errors import ConfigError
from fedmpi.imports import IMPORT_PATTERN

if TYPE_CHECKING:
    from fedmpi.component import Registry

__all__ = ["FRAMEWORK", "METRIC_NAMES", "framework_checks", "with_components", "FrameworkConfig", "DataConfig",
           "PartitionConfig", "SilosConfig", "TabularConfig", "ValidationConfig", "ModelConfig",
           "MLPConfig", "TrainConfig", "EarlyStoppingConfig", "AlgorithmConfig",
           "AggregationConfig", "SystemConfig", "PrivacyConfig", "DPConfig", "SecAggConfig",
           "EvalConfig", "PersonalConfig", "CheckpointConfig", "KeepBestConfig", "LoggingConfig", "MLflowConfig",
           "RuntimeConfig"]

_DATASETS = ("digits", "mnist", "fashionmnist", "cifar10", "cifar100", "svhn", "stl10",
             "imagefolder", "hdf5", "synthetic")
_TABULAR = ("tabular", "breast_cancer", "wine", "medpar")
_IMPORT: dict[str, Any] = dict(pattern=IMPORT_PATTERN, pattern_help="pkg.module:attr")
_MEDMNIST: dict[str, Any] = dict(pattern=r"medmnist:\S+", pattern_help="medmnist:<flag>")
_DATASET_PATTERN: dict[str, Any] = dict(pattern=f"medmnist:\\S+|{IMPORT_PATTERN}",
                                        pattern_help="medmnist:<flag> or pkg.module:attr")
#: ``eval.metrics`` names (:mod:`fedmpi.metrics`).
METRIC_NAMES = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")


#: The help of two keys that lists methods by what their ``MethodSpec`` declares; the
#: list is filled in from the method registry (:func:`with_components`).
_OPTIMIZER_HELP = ("client optimizer (state across rounds: train.optimizer_state); {} and "
                   "ECGR assume sgd")
_SERVER_LR_HELP = "server learning rate; null = method default (1; {})"


def _selector(help: str) -> Any:
    """A component selector: a registered name or ``pkg.module:Class``. Its default (the
    name of its kind's base class), choices and live registry come from the kind's registry
    (:func:`with_components`): the registries are above the config."""
    return param("", help, **_IMPORT)


# --------------------------------------------------------------------------- #
# data
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class PartitionConfig(CopyOnRead):
    """``data.partition.*``: how the training pool is split among the clients."""

    method: str = param("dirichlet", "how the training pool is split",
                        choices=("iid", "dirichlet", "shards", "file", "silos", "institutions"))
    alpha: float = param(0.5, "Dirichlet concentration", gt=0)
    classes_per_client: int = param(2, "classes per client (shards)", ge=1)
    min_size: int = param(10, "minimum samples per client", ge=0)
    file: str | None = param(None, "JSON partition file (method: file)", file=True)
    seed: int | None = param(None, "partition seed; null = top-level seed", ge=0, lt=2**63)


@dataclass(frozen=True)
class SilosConfig(CopyOnRead):
    """``data.silos.*``: silo-local data (:mod:`fedmpi.data.silos`); each rank reads only
    the silos it hosts."""

    path: str | None = param(None, "silos: per-client file template with {client} (index) "
                             "or {site} (name in data.silos.names) "
                             "(.csv/.parquet: feature columns + data.tabular.label; .h5: x, y)")
    loader: str | None = param(None, "silos: pkg.module:fn called as fn(client) -> "
                               "(x, y) on the rank hosting the client", **_IMPORT)
    test: str | None = param(None, "silos: test-set file, read by rank 0 only", file=True)
    validation: str | None = param(None, "silos: server validation file (FedVG), read "
                                   "by rank 0 only; null = none", file=True)
    client_test: str | None = param(None, "silos: per-client held-out test file "
                                    "template with {client}, read by the rank hosting the "
                                    "client (eval.where: clients | both); null = "
                                    "eval.client_holdout")
    names: list[str] | None = param(None, "silos: one name per client in client "
                                    "order (reports, logs, fedmpi stats); null = the {client} "
                                    "part of data.silos.path's file names, else 'client k'",
                                    pattern=r"[^\x00-\x1f\x7f|]{1,64}",
                                    pattern_help="a name of 1 to 64 characters without a "
                                                 "vertical bar or control characters")
    split: str = param("dirichlet", "how `fedmpi partition --export` splits "
                       "data.dataset into the silo files", choices=("iid", "dirichlet", "shards"))


@dataclass(frozen=True)
class TabularConfig(CopyOnRead):
    """``data.tabular.*``: tabular files (:mod:`fedmpi.data.tabular`)."""

    train: str | None = param(None, "dataset tabular: training-pool file "
                              "(.csv/.parquet/.h5)", file=True)
    test: str | None = param(None, "dataset tabular: test file", file=True)
    label: str = param("label", "label column of CSV/Parquet files")


@dataclass(frozen=True)
class ValidationConfig(CopyOnRead):
    """``data.validation.*``: the server's validation set."""

    fraction: float = param(0.1, "server hold-out share of the pool (0 = none)", ge=0, lt=1)
    source: str = param("holdout", "'holdout' or an external dataset name",
                        choices=("holdout",) + _DATASETS, **_MEDMNIST)
    per_class: int | None = param(None, "external source: samples per target "
                                  "class; null = paper count (stl10 550, cifar100 1200)", ge=1)
    size_fraction: float = param(1.0, "keep this stratified share of the FedVG "
                                 "validation set (FedVG A.7.1)", gt=0, le=1)
    rho: float | None = param(None, "class imbalance rho of the FedVG validation "
                              "set (Eqs. E.8-E.9); null = off", gt=0, le=1)


@dataclass(frozen=True)
class DataConfig(CopyOnRead):
    """``data.*``: the dataset and how it is split into silos."""

    dataset: str = param("digits", "dataset name, or pkg.module:fn returning a Dataset or "
                         "(train, test) map-style datasets", choices=_DATASETS + _TABULAR,
                         **_DATASET_PATTERN)
    root: str = param("./data", "directory holding (or receiving) dataset files")
    download: bool = param(False, "download torchvision datasets if missing")
    num_clients: int = param(10, "number of logical clients (silos)", ge=1)
    augment: bool = param(False, "random crop + flip on 32x32 RGB datasets")
    image_size: int = param(32, "imagefolder: side images are resized/cropped to", ge=1)
    partition: PartitionConfig = section(PartitionConfig)
    silos: SilosConfig = section(SilosConfig)
    tabular: TabularConfig = section(TabularConfig)
    validation: ValidationConfig = section(ValidationConfig)


# --------------------------------------------------------------------------- #
# model, client training
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class MLPConfig(CopyOnRead):
    """``model.mlp.*``."""

    hidden: list[int] = param([64, 64], "mlp: hidden layer widths", ge=1)


@dataclass(frozen=True)
class ModelConfig(CopyOnRead):
    """``model.*``: the architecture."""

    name: str = param("cnn", "architecture, or pkg.module:fn (input_shape, num_classes) "
                      "-> nn.Module", choices=("lenet", "cnn", "resnet18", "resnet34", "resnet50",
                                                "vit_s16", "vit_b16", "mlp"), **_IMPORT)
    mlp: MLPConfig = section(MLPConfig)
    norm: str = param("bn", "normalisation layers", choices=("bn", "static_bn", "gn"))


@dataclass(frozen=True)
class EarlyStoppingConfig(CopyOnRead):
    """``train.early_stopping.*``."""

    metric: str | None = param(None, "stop when this /rounds metric "
                               "(e.g. test_accuracy, test_loss, auroc) stops improving; "
                               "null = off")
    mode: str = param("max", "max: higher is better; min: lower", choices=("max", "min"))
    patience: int = param(5, "evaluated rounds without improvement before stopping", ge=1)
    min_delta: float = param(0.0, "an improvement is a change beyond this", ge=0)


@dataclass(frozen=True)
class TrainConfig(CopyOnRead):
    """``train.*``: the client side of a round."""

    rounds: int = param(30, "communication rounds", ge=1)
    clients_per_round: int | None = param(None, "participants per round; null = all", ge=1)
    local_epochs: int = param(1, "local epochs per round", ge=1)
    local_steps: int | None = param(None, "local steps per round; overrides epochs", ge=1)
    batch_size: int = param(32, "client batch size", ge=1)
    lr: float = param(0.05, "client learning rate", gt=0)
    momentum: float = param(0.0, "client SGD momentum", ge=0, lt=1)
    weight_decay: float = param(0.0, "client weight decay", ge=0)
    optimizer: str = param("sgd", _OPTIMIZER_HELP.format("some methods"),
                           choices=("sgd", "adam", "adamw"))
    optimizer_state: str = param("reset", "client optimizer state (SGD momentum; Adam "
                                 "m, v, t) across a client's participations: reset = fresh "
                                 "every client-round; keep = kept on the client's rank and "
                                 "checkpointed (1-2 P floats per hosted client)",
                                 choices=("reset", "keep"))
    betas: list[float] = param([0.9, 0.999], "adam/adamw: (beta1, beta2)", ge=0, lt=1)
    eps: float = param(1e-8, "adam/adamw: epsilon of the denominator", gt=0)
    loss: str = param("cross_entropy", "client training loss (evaluation's test_loss is "
                      "always cross-entropy)", choices=("cross_entropy", "bce_logits"))
    class_weights: list[float] | None = param(None, "loss weight per class (C entries); "
                                              "null = equal", ge=0)
    label_smoothing: float = param(0.0, "label smoothing eps: target (1 - eps) one-hot "
                                   "+ eps / C", ge=0, lt=1)
    early_stopping: EarlyStoppingConfig = section(EarlyStoppingConfig)
    grad_clip: float | None = param(None, "max gradient norm; null = no clipping", gt=0)
    lr_decay: float = param(1.0, "step decay: round t uses lr * lr_decay^floor(t / "
                            "lr_decay_every) (ECGR paper: 0.5 every 10 rounds)", gt=0, le=1)
    lr_decay_every: int = param(0, "rounds per lr_decay step; 0 = constant lr", ge=0)


# --------------------------------------------------------------------------- #
# component selectors (their blocks algorithm.<block>.*, aggregation.<block>.*, <name>.*
# are assembled from the registered components in fedmpi.config.schema)
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class AlgorithmConfig(CopyOnRead):
    """``algorithm.*`` of the framework: the method, a user method's parameters, the
    server learning rate (methods' blocks ``algorithm.<block>.*``: ``cfg.get``)."""

    name: str = _selector("federated method, or pkg.module:Class (a subclass of "
                          "fedmpi.methods.base.Algorithm)")
    params: dict[str, Any] = param({}, "parameters of a user method (pkg.module:Class), "
                                   "checked against its params['params'] dataclass")
    server_lr: float | None = param(None, _SERVER_LR_HELP.format("see the method"), gt=0)


@dataclass(frozen=True)
class AggregationConfig(CopyOnRead):
    """``aggregation.*`` of the framework: client weights, the server-side rule, a user
    rule's parameters (weightings' and rules' blocks ``aggregation.<block>.*``: ``cfg.get``)."""

    weighting: str = _selector("client weights in the server average, or "
                               "pkg.module:Class (a Weighting subclass)")
    rule: str = _selector("server-side aggregation rule (fedmpi.aggregation.rules), or "
                          "pkg.module:Class (a ServerRule subclass); robust rules: "
                          "docs/robust-aggregation.md")
    params: dict[str, Any] = param({}, "parameters of a user rule (pkg.module:Class), "
                                   "checked against its params['params'] dataclass")


@dataclass(frozen=True)
class SystemConfig(CopyOnRead):
    """``system.*``: system heterogeneity (FedLAGC, HeteroFL, ...)."""

    levels: list[float] | None = param(None, "resource levels r in (0, 1]", gt=0, le=1)
    allocation: list[int] | None = param(None, "clients per resource level", ge=0)
    slowdown: list[float] | None = param(None, "one factor per client: its training takes "
                                         "this many times as long (round.clock virtual: "
                                         "the simulated time; null = 1 for all)", gt=0)


# --------------------------------------------------------------------------- #
# privacy (fedmpi.privacy): differential privacy with a dp-accounting accountant
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class DPConfig(CopyOnRead):
    """``privacy.dp.*``: differential privacy."""

    level: str = param("none", "differential privacy: client = DP-FedAvg (each "
                       "client's update clipped, Gaussian noise on the sum), record = "
                       "DP-SGD inside each silo (per-sample clipping, Poisson batches)",
                       choices=("none", "client", "record"))
    noise: str = param("central", "client level: who adds the noise std sigma*C to "
                       "the sum: rank 0 (central) or every participant a share "
                       "(distributed)", choices=("central", "distributed"))
    noise_multiplier: float = param(1.0, "sigma: noise std / clip norm (0 = "
                                    "clipping only, epsilon infinite)", ge=0)
    clip: float = param(1.0, "C: l2 clip norm of a client's update (client) or of a "
                        "sample's gradient (record)", gt=0)
    delta: float = param(1e-5, "delta at which epsilon is reported", gt=0, lt=1)
    accountant: str = param("rdp", "dp-accounting accountant: rdp (Renyi DP) or pld "
                            "(privacy loss distributions; not for fixed-size client "
                            "sampling)", choices=("rdp", "pld"))


@dataclass(frozen=True)
class SecAggConfig(CopyOnRead):
    """``privacy.secagg.*``: secure aggregation."""

    scale_bits: int = param(24, "fixed-point fractional bits f of secure "
                            "aggregation (ring 2^48: |sum| < 2^(47-f))", ge=8, le=40)


@dataclass(frozen=True)
class PrivacyConfig(CopyOnRead):
    """``privacy.*``."""

    dp: DPConfig = section(DPConfig)
    target_epsilon: float | None = param(None, "stop the run (status completed) before "
                                         "the next round would take epsilon above this; "
                                         "null = no budget", gt=0)
    secure_aggregation: bool = param(False, "pairwise-masked secure aggregation: rank 0 "
                                     "only holds sums over the accepted clients (extra "
                                     ".[privacy])")
    secagg: SecAggConfig = section(SecAggConfig)


# --------------------------------------------------------------------------- #
# evaluation, outputs, runtime
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class EvalConfig(CopyOnRead):
    """``eval.*``: who evaluates the global model, when, on what metrics."""

    every: int = param(1, "evaluate every N rounds", ge=1)
    batch_size: int = param(1024, "evaluation batch size", ge=1)
    metrics: list[str] = param(["accuracy"], "test metrics logged as /rounds/<metric> "
                               "(accuracy is test_accuracy), or pkg.module:fn(labels, "
                               "probabilities) -> float logged as /rounds/fn; auroc and user "
                               "metrics evaluate on rank 0 only", choices=METRIC_NAMES,
                               **_IMPORT)
    where: str = param("server", "who evaluates the global model: server = rank 0 on "
                       "the test set; clients = every client on its own held-out data (rank 0 "
                       "reads no test file); both", choices=("server", "clients", "both"))
    client_holdout: float | None = param(None, "eval.where clients | both: share of each "
                                         "client's samples held out for its evaluation (fixed "
                                         "by seed, removed from training), unless "
                                         "data.silos.client_test names files", gt=0, lt=1)
    overlap: bool = param(True, "rank 0 evaluates round t's model while the workers train "
                          "round t+1 (world_size > 1, not sharded); round t's log row is "
                          "written then")
    sharded: bool = param(False, "every rank evaluates a slice of the test set (one extra "
                          "state Bcast per evaluation round); rank 0 alone when false")
    cross_site: bool = param(False, "after the last round, the global model and every site's "
                             "local model (one local training from the final global model) "
                             "evaluated on every site's held-out data, on the ranks holding "
                             "it: /cross_site/<metric> [sites, 1 + sites]; a personalised method "
                             "adds each site's personal model: [sites, 1 + 2 sites] (not with "
                             "secure aggregation or differential privacy)")
    local_only: bool = param(False, "after the last round, each site also trains alone from the "
                             "initial model for the local steps it took in the federation and "
                             "scores it on its held-out data (/site_models; needs eval.where "
                             "clients or both)")
    finetune_epochs: int = param(0, "after the last round, each site fine-tunes the final global "
                                 "model for this many local epochs and scores it on its held-out "
                                 "data (/site_models; needs eval.where clients or both); 0 = off",
                                 ge=0)
    cross_site_models: bool = param(False, "with eval.cross_site: rank 0 writes each site's "
                                    "local model to local_models/<site>.pt, a personalised "
                                    "method's personal models to local_models/personal/<site>.pt "
                                    "(refused if one exists, unless --overwrite or --resume)")


@dataclass(frozen=True)
class PersonalConfig(CopyOnRead):
    """``personal.*``: parameters that stay at their site (docs/personalisation.md)."""

    params: list[str] = param([], "name patterns (fnmatch, e.g. 'fc2.*') of parameters and "
                              "float buffers that are trained at each site and never leave its "
                              "rank (kept per client, excluded from every message), besides "
                              "those the method declares (fedbn, fedper, fedrep)")


@dataclass(frozen=True)
class KeepBestConfig(CopyOnRead):
    """``checkpoint.keep_best.*``: the best model (:mod:`fedmpi.runtime.callbacks`)."""

    metric: str | None = param(None, "write best.pt beside model.pt for the round that is "
                               "best in this /rounds metric; null = off")
    mode: str = param("max", "max: higher is better; min: lower", choices=("max", "min"))


@dataclass(frozen=True)
class CheckpointConfig(CopyOnRead):
    """``checkpoint.*``."""

    keep_best: KeepBestConfig = section(KeepBestConfig)


@dataclass(frozen=True)
class MLflowConfig(CopyOnRead):
    """``logging.mlflow.*``."""

    tracking_uri: str | None = param(None, "MLflow tracking URI (e.g. file:/path/mlruns) "
                                     "logged per round (extra fedmpi[mlflow]); null = off")
    experiment: str = param("fedmpi", "MLflow experiment name")


@dataclass(frozen=True)
class LoggingConfig(CopyOnRead):
    """``logging.*``: experiment trackers (:mod:`fedmpi.log.trackers`), live views of the
    HDF5 log written from rank 0."""

    tensorboard: str | None = param(None, "TensorBoard event directory written per round "
                                    "(extra fedmpi[tensorboard]); null = off")
    mlflow: MLflowConfig = section(MLflowConfig)


@dataclass(frozen=True)
class RuntimeConfig(CopyOnRead):
    """``runtime.*``: devices, threads, timeouts, MPI messages, outputs."""

    device: str = param("auto", "torch device", choices=("auto", "cpu"),
                        pattern=r"cuda(:\d+)?", pattern_help="cuda[:N]")
    out_dir: str = param("runs", "parent directory of run outputs")
    checkpoint_every: int = param(0, "checkpoint every N rounds (0 = only at exit)", ge=0)
    replay: str | None = param(None, "a deadline or buffered run's log (or run directory): "
                               "apply the server steps it recorded, each with the same "
                               "updates (client, model version, staleness weight), in "
                               "order; null = the round policy decides")
    round_timeout: float = param(600.0, "abort if a round's collective waits longer "
                                 "(seconds), naming the ranks and hosts that are missing", gt=0)
    setup_timeout: float = param(1800.0, "start-up limit (seconds): every rank must have "
                                 "loaded its data and built its model by then, else the job "
                                 "stops naming the slow rank", gt=0)
    max_rounds_without_update: int = param(10, "end the run as failed (exit 1) after this "
                                           "many consecutive rounds in which no client update "
                                           "was accepted (0 = never)", ge=0)
    progress: bool = param(True, "show a progress bar")
    max_message_bytes: int | None = param(None, "largest MPI message in bytes; longer "
                                          "buffers stream in pieces, at most 3 in flight per "
                                          "rank (same result bit for bit); null = 16 MiB "
                                          "(at most 2^30 elements, below MPI's 2^31 - 1 count "
                                          "limit)", ge=1)
    reduction: str = param("default", "how the uplink sums reach rank 0: default = "
                           "summed on each worker, then over ranks (equal across world sizes "
                           "up to float rounding); exact = one row per client, summed in "
                           "client-id order on rank 0 (bit-identical for every world size "
                           "and rank layout at pinned runtime.threads; evaluation not "
                           "sharded)", choices=("default", "exact"))
    wire: str = param("float64", "number type of the summed uplink statistics between ranks "
                      "(runtime.reduction: default, no secure aggregation): float64 = each "
                      "rank's partial sum as it is, the same float32 model at any world size "
                      "in practice; float32 = half the bytes, each partial sum rounded once, "
                      "so the model depends on the world size in the last bits "
                      "(docs/large-models.md)", choices=("float64", "float32"))
    ranks_per_silo: int = param(1, "ranks that train each silo's clients together, "
                                "data-parallel: each takes its share of every batch and the "
                                "gradients are summed over them every step; the workers "
                                "(world size - 1) are split into groups of this many, each "
                                "group one voice in the federation (its first rank)", ge=1)
    silo_placement: str = param("node", "where a silo's ranks may run: node = on one node "
                                "(refused when a node's workers do not split into whole "
                                "silos); any = on one node where the layout allows, else "
                                "across nodes", choices=("node", "any"))
    threads: int | None = param(None, "torch threads per rank; null = OMP_NUM_THREADS, "
                                "else SLURM_CPUS_PER_TASK, else usable cores / ranks on the "
                                "node", ge=1)
    autocast: str = param("off", "forward pass under torch.autocast (bf16: parameters, "
                          "updates and aggregation stay float32); for GPU runs",
                          choices=("off", "bf16"))
    channels_last: bool = param(False, "feed image batches channels-last (NHWC) to the "
                                "model; for GPU convolutions")
    deterministic: bool = param(False, "deterministic GPU kernels, no TF32 (bit-"
                                "reproducible CUDA runs; slower)")
    compile: bool = param(False, "wrap the model's forward in torch.compile")
    compile_mode: str = param("default", "torch.compile mode (reduce-overhead = CUDA "
                              "graphs)", choices=("default", "reduce-overhead", "max-autotune",
                                                  "max-autotune-no-cudagraphs"))


# --------------------------------------------------------------------------- #
# the whole run
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class FrameworkConfig(CopyOnRead):
    """Every framework key, by section, in the order :meth:`Config.to_dict` writes them;
    the components' blocks are inserted after their kind's anchor key
    (``algorithm.server_lr``, ``aggregation.params``, ``transforms``;
    :mod:`fedmpi.config.schema`)."""

    name: str = param("quickstart", "run name; output goes to runtime.out_dir/<name>/",
                      pattern=r"(?!\.\.?$)[^/\\\x00-\x1f\x7f]+",
                      pattern_help="a non-empty name without '/' or control characters")
    seed: int = param(0, "master seed: sampling, client RNG streams, surrogate data", ge=0,
                      lt=2**63)
    data: DataConfig = section(DataConfig)
    model: ModelConfig = section(ModelConfig)
    train: TrainConfig = section(TrainConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    aggregation: AggregationConfig = section(AggregationConfig)
    system: SystemConfig = section(SystemConfig)
    #: user update transforms (fedmpi/transforms/base.py), after the registered ones
    transforms: list[str] = param([], "update transforms by import path (pkg.module:Class, "
                                  "a subclass of fedmpi.transforms.base.UpdateTransform built "
                                  "with the config), applied in this order around any method",
                                  **_IMPORT)
    round: RoundConfig = section(RoundConfig)
    privacy: PrivacyConfig = section(PrivacyConfig)
    personal: PersonalConfig = section(PersonalConfig)
    eval: EvalConfig = section(EvalConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    runtime: RuntimeConfig = section(RuntimeConfig)


#: The framework's keys (dotted key → Field), in the order :meth:`Config.to_dict` writes
#: them; component blocks are inserted after their kind's anchor key.
FRAMEWORK: dict[str, Field] = section_fields(FrameworkConfig)

#: The keys that select a component of a registered kind by name.
_SELECTORS = ("algorithm.name", "aggregation.weighting", "aggregation.rule")


def with_components(fields: Mapping[str, Field], registries: Mapping[str, Registry],
                    methods: Registry) -> dict[str, Field]:
    """``fields`` (:data:`FRAMEWORK`) completed by the registries of the component kinds,
    which live above the config and are handed in by :mod:`fedmpi.config.schema`
    (``registries``: selector key → registry, ``methods``: the methods' registry):

    * each selector (``algorithm.name``, ``aggregation.weighting``, ``aggregation.rule``)
      defaults to its kind's base class, lists the names registered now (for the docs and
      the errors) and is checked against the live registry (names registered later count);
    * the help of ``train.optimizer`` and ``algorithm.server_lr`` names the methods by
      what their ``MethodSpec`` declares.
    """
    out = dict(fields)
    for key in _SELECTORS:
        registry = registries[key]
        out[key] = dataclasses.replace(out[key], default=registry.default,
                                       choices=tuple(registry),
                                       registry=registry.keys)
    sgd_only = ", ".join(name for name, cls in methods.items() if cls.spec.optimizers == ("sgd",))
    lrs = ", ".join(f"{name} {cls.spec.default_server_lr:g}" for name, cls in methods.items()
                    if cls.spec.default_server_lr != 1)
    out["train.optimizer"] = dataclasses.replace(out["train.optimizer"],
                                                 help=_OPTIMIZER_HELP.format(sgd_only))
    out["algorithm.server_lr"] = dataclasses.replace(out["algorithm.server_lr"],
                                                     help=_SERVER_LR_HELP.format(lrs))
    return out


def framework_checks(cfg: Config) -> None:
    """The framework's rules that involve more than one key (data, sampling, resource
    levels); raise ConfigError on the first violation."""
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
    _privacy_checks(cfg)
    round_checks(cfg)


def _privacy_checks(cfg: Config) -> None:
    """``privacy.*`` against the rest, for every level (client-level DP's own rules are
    :meth:`fedmpi.privacy.client_dp.ClientDP.check`; docs/privacy.md says why each is refused)."""
    p = cfg.privacy
    level = p.dp.level
    if level == "none" and p.target_epsilon is not None:
        raise ConfigError("config key 'privacy.target_epsilon' needs privacy.dp.level client or "
                          "record (privacy.dp.level is 'none': no epsilon to budget)")
    t = cfg.train
    if level == "record" and (t.loss != "cross_entropy" or t.class_weights is not None
                              or t.label_smoothing != 0.0):
        raise ConfigError("config key 'train.loss' (with train.class_weights, "
                          "train.label_smoothing) must be the plain cross_entropy with "
                          "privacy.dp.level 'record' (DP-SGD clips per-sample cross-entropy "
                          "gradients)")


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
                              f"{{client}} (the client's index) or {{site}} (its name in "
                              f"data.silos.names) as its only fields, e.g. silos/{{client}}.csv; "
                              f"got {s.path!r}")
        if s.test is None and cfg.eval.where != "clients":
            raise ConfigError("config key 'data.silos.test' is required when "
                              "data.partition.method is 'silos' (rank 0 reads the test set), "
                              "unless eval.where is 'clients'")
        if cfg.eval.sharded:
            raise ConfigError("config key 'eval.sharded' must be false when data.partition.method "
                              "is 'silos' (rank 0 alone holds the test set)")
    names = d.silos.names
    for key in ("path", "client_test"):
        template = getattr(d.silos, key)
        if names is None and template is not None and "{site}" in template:
            raise ConfigError(f"config key 'data.silos.{key}' uses {{site}}, which needs "
                              "data.silos.names (one name per client)")
    if names is not None:
        if len(names) != d.num_clients:
            raise ConfigError(f"config key 'data.silos.names' must give one name per client: "
                              f"{len(names)} names for data.num_clients {d.num_clients}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"config key 'data.silos.names' lists {twice[0]!r} twice "
                              "(each site needs its own name)")
    if d.dataset == "tabular":
        for key in ("train", "test"):
            if getattr(d.tabular, key) is None:
                raise ConfigError(f"config key 'data.tabular.{key}' is required when "
                                  "data.dataset is 'tabular'")


def _client_template(path: str) -> bool:
    """Whether ``path`` is a file template whose only fields are ``{client}`` and
    ``{site}`` (:func:`fedmpi.data.silos.silo_path`), naming each client's file apart."""
    try:
        return path.format(client=0, site="a") != path.format(client=1, site="b")
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


def _metric_names(cfg: Config) -> list[str]:
    """The ``/rounds`` metrics early stopping and the best model may follow."""
    from fedmpi.metrics import extra_names

    own = ["test_loss", "test_accuracy", *extra_names(cfg.eval.metrics)]
    sites = [f"clients_{m}" for m in own] if cfg.eval.where == "both" else []
    return [*own, "train_loss", *sites]


def _eval_checks(cfg: Config) -> None:
    """Where evaluation happens, user metric names, the metrics followed by early stopping
    and the best model."""
    from fedmpi.metrics import RESERVED, is_user_metric, metric_name

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
                              f"with {{client}} or {{site}} as its only fields, got "
                              f"{s.client_test!r}")
    if e.where != "server":
        if s.client_test is None and e.client_holdout is None:
            raise ConfigError(f"config key 'eval.client_holdout' (a share such as 0.2) or "
                              f"'data.silos.client_test' must be set when eval.where is "
                              f"{e.where!r}: each client evaluates on data it does not train on")
        if e.sharded:
            raise ConfigError(f"config key 'eval.sharded' must be false when eval.where is "
                              f"{e.where!r} (the clients evaluate their own data)")
    _cross_site_checks(cfg)
    for key, on in (("eval.local_only", e.local_only), ("eval.finetune_epochs", e.finetune_epochs)):
        if on and e.where == "server":
            raise ConfigError(f"config keys {key!r} and 'eval.where': the site models are scored "
                              "on each site's held-out data; set eval.where: clients or both")
    allowed = _metric_names(cfg)
    for key in ("train.early_stopping.metric", "checkpoint.keep_best.metric"):
        metric = cfg.get(key)
        if metric is not None and metric not in allowed:
            raise ConfigError(f"config key {key!r} must name a logged metric, one of "
                              f"{', '.join(allowed)}; got {metric!r}{suggest(metric, allowed)}")


def _cross_site_checks(cfg: Config) -> None:
    """``eval.cross_site``: held-out data at every site and no privacy promise that a local
    model in the clear would break (docs/consortium.md, "Cross-site validation"); the
    method's side is :func:`fedmpi.config.schema.check_components`'."""
    e, s, p = cfg.eval, cfg.data.silos, cfg.privacy
    if e.cross_site_models and not e.cross_site:
        raise ConfigError("config key 'eval.cross_site_models' needs eval.cross_site: true "
                          "(the local models are trained by the cross-site validation)")
    if not e.cross_site:
        return
    # every key to change, so the advice works as written (issue 48)
    off = "set eval.cross_site: false" + (" and eval.cross_site_models: false"
                                          if e.cross_site_models else "")
    if p.secure_aggregation:
        raise ConfigError("config keys 'eval.cross_site' and 'privacy.secure_aggregation': "
                          "a site's local model is its update in the clear, which secure "
                          f"aggregation promises rank 0 never sees; {off}")
    if p.dp.level != "none":
        raise ConfigError(f"config keys 'eval.cross_site' and 'privacy.dp.level' "
                          f"({p.dp.level!r}): a site's local model is its update without the "
                          f"privacy accounting's noise or budget; {off}")
    if s.client_test is None and e.client_holdout is None:
        raise ConfigError("config key 'eval.client_holdout' (a share such as 0.2) or "
                          "'data.silos.client_test' must be set with eval.cross_site: every "
                          "site evaluates the models on data it does not train on")
