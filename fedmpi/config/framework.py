"""The framework's own config keys and their cross-key rules.

:data:`FRAMEWORK` declares every key that is not a component's parameter: run name
and seed, ``data.*``, ``model.*``, ``train.*``, the component selectors
``algorithm.name``, ``aggregation.weighting``, ``transforms``, ``system.*``,
``eval.*``, ``privacy.*`` and ``runtime.*``; :func:`framework_checks` holds the rules
that involve more than one of them (data, sampling, resource levels, privacy,
evaluation metrics). :mod:`fedmpi.config.schema` assembles the run's schema from this table
and the parameter blocks and rules of the registered components; no component is
named here. Over ~350 lines because it is one table: every framework key with its
type, default, range and help, next to the rules that relate them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmpi.methods import ALGORITHMS
from fedmpi.aggregation.rules import RULES, ServerRule
from fedmpi.aggregation.weighting import WEIGHTINGS, Weighting
from fedmpi.methods.base import Algorithm
from fedmpi.config.core import Config
from fedmpi.config.fields import Field, suggest
from fedmpi.errors import ConfigError
from fedmpi.imports import IMPORT_PATTERN

__all__ = ["FRAMEWORK", "METRIC_NAMES", "framework_checks"]

_DATASETS = ("digits", "mnist", "fashionmnist", "cifar10", "cifar100", "svhn", "stl10",
             "imagefolder", "hdf5", "synthetic")
_TABULAR = ("tabular", "breast_cancer", "wine")
_IMPORT: dict[str, Any] = dict(pattern=IMPORT_PATTERN, pattern_help="pkg.module:attr")
_MEDMNIST: dict[str, Any] = dict(pattern=r"medmnist:\S+", pattern_help="medmnist:<flag>")
_DATASET_PATTERN: dict[str, Any] = dict(pattern=f"medmnist:\\S+|{IMPORT_PATTERN}",
                                        pattern_help="medmnist:<flag> or pkg.module:attr")
#: ``eval.metrics`` names (:mod:`fedmpi.metrics`).
METRIC_NAMES = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")


def _other_server_lrs() -> str:
    """The built-in methods whose default server learning rate is not 1 (for the help)."""
    return ", ".join(f"{name} {cls.spec.default_server_lr:g}" for name, cls in ALGORITHMS.items()
                     if cls.spec.default_server_lr != 1)


def _sgd_only() -> str:
    """The built-in methods whose math assumes SGD steps (``MethodSpec.optimizers``)."""
    return ", ".join(name for name, cls in ALGORITHMS.items() if cls.spec.optimizers == ("sgd",))


#: The framework's keys, in the order :meth:`Config.to_dict` writes them; component
#: blocks are inserted after their kind's anchor key (:data:`_KINDS`).
FRAMEWORK: dict[str, Field] = {
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
    "data.silos.names": Field(list[str] | None, None, "silos: one name per client in client "
                              "order (reports, logs, fedmpi stats); null = the {client} part of "
                              "data.silos.path's file names, else 'client k'",
                              pattern=r"[^\x00-\x1f\x7f|]{1,64}",
                              pattern_help="a name of 1 to 64 characters without a vertical bar or "
                                           "control characters"),
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
    "train.optimizer": Field(str, "sgd", "client optimizer (state across rounds: "
                             f"train.optimizer_state); {_sgd_only()} and ECGR assume sgd",
                             choices=("sgd", "adam", "adamw")),
    "train.optimizer_state": Field(str, "reset", "client optimizer state (SGD momentum; Adam "
                                   "m, v, t) across a client's participations: reset = fresh "
                                   "every client-round; keep = kept on the client's rank and "
                                   "checkpointed (1-2 P floats per hosted client)",
                                   choices=("reset", "keep")),
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
    "algorithm.name": Field(str, Algorithm.name, "federated method, or pkg.module:Class (a subclass "
                            "of fedmpi.methods.base.Algorithm)", choices=tuple(ALGORITHMS), **_IMPORT,
                            registry=lambda: ALGORITHMS),
    "algorithm.params": Field(dict, {}, "parameters of a user method (pkg.module:Class), checked "
                              "against its params['params'] dataclass"),
    "algorithm.server_lr": Field(float | None, None, "server learning rate; null = method default "
                                 f"(1; {_other_server_lrs()})", gt=0),
    # method blocks algorithm.<block>.*: assembled from the registered methods (_assemble)
    # aggregation weights
    "aggregation.weighting": Field(str, Weighting.name, "client weights in the server average, or "
                                   "pkg.module:Class (a Weighting subclass)",
                                   choices=tuple(WEIGHTINGS), **_IMPORT,
                                   registry=lambda: WEIGHTINGS),
    "aggregation.rule": Field(str, ServerRule.name, "server-side aggregation rule "
                              "(fedmpi.aggregation.rules), or pkg.module:Class (a ServerRule "
                              "subclass); robust rules: docs/robust-aggregation.md",
                              choices=tuple(RULES), **_IMPORT, registry=lambda: RULES),
    "aggregation.params": Field(dict, {}, "parameters of a user rule (pkg.module:Class), checked "
                                "against its params['params'] dataclass"),
    # rule and weighting blocks aggregation.<block>.*: assembled from the registered ones
    # system heterogeneity (FedLAGC, HeteroFL, ...)
    "system.levels": Field(list[float] | None, None, "resource levels r in (0, 1]", gt=0, le=1),
    "system.allocation": Field(list[int] | None, None, "clients per resource level", ge=0),
    # user update transforms (fedmpi/transforms/base.py), after ECGR and the adversary
    "transforms": Field(list[str], [], "update transforms by import path (pkg.module:Class, "
                        "a subclass of fedmpi.transforms.base.UpdateTransform built with the config), "
                        "applied in this order around any method", **_IMPORT),
    # transform blocks <name>.* (ecgr.*, adversary.*): assembled from the registered transforms
    # privacy (fedmpi.privacy): differential privacy with a dp-accounting accountant
    "privacy.dp.level": Field(str, "none", "differential privacy: client = DP-FedAvg (each "
                              "client's update clipped, Gaussian noise on the sum), record = "
                              "DP-SGD inside each silo (per-sample clipping, Poisson batches)",
                              choices=("none", "client", "record")),
    "privacy.dp.noise": Field(str, "central", "client level: who adds the noise std sigma*C to "
                              "the sum: rank 0 (central) or every participant a share "
                              "(distributed)", choices=("central", "distributed")),
    "privacy.dp.noise_multiplier": Field(float, 1.0, "sigma: noise std / clip norm (0 = "
                                         "clipping only, epsilon infinite)", ge=0),
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
    # best model (fedmpi/runtime/callbacks.py)
    "checkpoint.keep_best.metric": Field(str | None, None, "write best.pt beside model.pt for "
                                         "the round that is best in this /rounds metric; null = "
                                         "off"),
    "checkpoint.keep_best.mode": Field(str, "max", "max: higher is better; min: lower",
                                       choices=("max", "min")),
    # experiment trackers (fedmpi/log/trackers.py): live views of the HDF5 log, from rank 0
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
    "runtime.round_timeout": Field(float, 600.0, "abort if a round's collective waits longer "
                                   "(seconds), naming the ranks and hosts that are missing", gt=0),
    "runtime.setup_timeout": Field(float, 1800.0, "start-up limit (seconds): every rank must have "
                                   "loaded its data and built its model by then, else the job "
                                   "stops naming the slow rank", gt=0),
    "runtime.max_rounds_without_update": Field(int, 10, "end the run as failed (exit 1) after this "
                                               "many consecutive rounds in which no client update "
                                               "was accepted (0 = never)", ge=0),
    "runtime.progress": Field(bool, True, "show a progress bar"),
    "runtime.max_message_bytes": Field(int | None, None, "largest MPI message in bytes; longer "
                                       "buffers go in pieces (same result bit for bit); null = "
                                       "2^30 elements per call, below MPI's 2^31 - 1 count limit",
                                       ge=1),
    "runtime.reduction": Field(str, "default", "how the uplink sums reach rank 0: default = "
                               "summed on each worker, then over ranks (equal across world sizes "
                               "up to float rounding); exact = one row per client, summed in "
                               "client-id order on rank 0 (bit-identical for every world size "
                               "and rank layout at pinned runtime.threads; evaluation not "
                               "sharded)", choices=("default", "exact")),
    "runtime.threads": Field(int | None, None, "torch threads per rank; null = OMP_NUM_THREADS, "
                             "else SLURM_CPUS_PER_TASK, else usable cores / ranks on the node",
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
                              f"{{client}} as its only field, e.g. silos/{{client}}.csv; got "
                              f"{s.path!r}")
        if s.test is None and cfg.eval.where != "clients":
            raise ConfigError("config key 'data.silos.test' is required when "
                              "data.partition.method is 'silos' (rank 0 reads the test set), "
                              "unless eval.where is 'clients'")
        if cfg.eval.sharded:
            raise ConfigError("config key 'eval.sharded' must be false when data.partition.method "
                              "is 'silos' (rank 0 alone holds the test set)")
    names = d.silos.names
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
                              f"with {{client}} as its only field, got {s.client_test!r}")
    if e.where != "server":
        if s.client_test is None and e.client_holdout is None:
            raise ConfigError(f"config key 'eval.client_holdout' (a share such as 0.2) or "
                              f"'data.silos.client_test' must be set when eval.where is "
                              f"{e.where!r}: each client evaluates on data it does not train on")
        if e.sharded:
            raise ConfigError(f"config key 'eval.sharded' must be false when eval.where is "
                              f"{e.where!r} (the clients evaluate their own data)")
    allowed = _metric_names(cfg)
    for key in ("train.early_stopping.metric", "checkpoint.keep_best.metric"):
        metric = cfg.get(key)
        if metric is not None and metric not in allowed:
            raise ConfigError(f"config key {key!r} must name a logged metric, one of "
                              f"{', '.join(allowed)}; got {metric!r}{suggest(metric, allowed)}")
