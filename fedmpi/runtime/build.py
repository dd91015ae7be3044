"""Building one rank of a run: process settings, data, model, method, placement.

Everything here is computed identically on every rank from the config (the
partition, the initial model from the seed, the client placement), so no
message is needed to agree on it. The result is a :class:`Built` record and
the :class:`~fedmpi.context.Context` that methods, the weighting and the
update transforms receive in their ``setup`` — in this order: method,
weighting, transforms, server rule; then the uplink statistics are planned.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fedmpi.training.accel import Accel, set_deterministic
from fedmpi.component import Component, Stat, start
from fedmpi.log.row import Reports
from fedmpi.methods.base import Algorithm
from fedmpi.runtime.server import ServerParts
from fedmpi.transforms.base import RunParts
from fedmpi.aggregation.rules import ServerRule, build_rule
from fedmpi.transforms.base import TransformChain, build_transforms
from fedmpi.aggregation.weighting import Weighting
from fedmpi.comm.world import Comm
from fedmpi.config.core import Config
from fedmpi.context import Context
from fedmpi.data import preprocessing
from fedmpi.data.base import Dataset
from fedmpi.data.partition import Partition
from fedmpi.data.silos import build_local
from fedmpi.errors import ConfigError
from fedmpi.training.flat import FlatModel
from fedmpi.imports import blame
from fedmpi.usercode import UserCode
from fedmpi.models import build_model, model_spec
from fedmpi.job.placement import default_threads, gpu_for_local_rank
from fedmpi.job.provenance import run_info
from fedmpi.runtime.evaluation import test_state
from fedmpi.runtime.memory import check_fits


def resolve_device(spec: str, local_rank: int) -> torch.device:
    """``runtime.device``: auto → CUDA if available else CPU; ``cuda`` picks
    GPU ``local_rank mod #GPUs`` (one rank per GPU on a node)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"config key 'runtime.device' is {spec!r} but no CUDA device is available "
                          "(use 'auto' or 'cpu')")
    if spec == "cuda":
        gpu = gpu_for_local_rank(local_rank, torch.cuda.device_count())
        return torch.device("cuda", 0 if gpu is None else gpu)
    return torch.device(spec)


def client_hosts(num_clients: int, world_size: int) -> np.ndarray:
    """Rank hosting each client: 1 + k mod W with W = world_size − 1 workers, or
    rank 0 for every client when it is alone."""
    workers = max(1, world_size - 1)
    return np.array([0 if world_size == 1 else 1 + k % workers for k in range(num_clients)])


def participants(seed: int, num_clients: int, m: int, t: int) -> np.ndarray:
    """Boolean mask of S_t: m of K clients without replacement, RNG (seed, t)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1EC7, t]))
    mask = np.zeros(num_clients, dtype=bool)
    mask[rng.choice(num_clients, size=m, replace=False)] = True
    return mask


def carries_state(train) -> bool:
    """Whether the client optimizer of the ``train`` block has state a round could carry
    over (``train.optimizer_state: keep``): Adam/AdamW always, SGD with momentum."""
    return train.optimizer != "sgd" or bool(train.momentum)


def check_training_keys(cfg: Config, algo_class: type[Algorithm], num_classes: int) -> None:
    """``train.optimizer`` among the method's ``optimizers``, ``train.loss`` and its
    options only for methods without their own loss, one class weight per class."""
    t, name = cfg.train, cfg.algorithm.name
    spec = algo_class.spec_for(cfg)
    if t.optimizer not in spec.optimizers:
        raise ConfigError(f"config keys 'train.optimizer' and 'algorithm.name': {name!r} "
                          f"assumes {' or '.join(spec.optimizers)} steps in its math, got "
                          f"train.optimizer {t.optimizer!r}")
    if spec.fresh_optimizer and t.optimizer_state == "keep" and carries_state(t):
        raise ConfigError(f"config keys 'train.optimizer_state' and 'train.momentum': {name!r} "
                          "needs a fresh optimizer every client-round (its math uses this "
                          "round's steps from a zero momentum buffer); set "
                          "train.optimizer_state: reset or train.momentum: 0")
    plain = t.loss == "cross_entropy" and t.class_weights is None and t.label_smoothing == 0
    if spec.own_loss and not plain:
        raise ConfigError(f"config keys 'train.loss' and 'algorithm.name': {name!r} trains with "
                          "its own loss; leave train.loss, train.class_weights and "
                          "train.label_smoothing at their defaults")
    if t.class_weights is not None and len(t.class_weights) != num_classes:
        raise ConfigError(f"config key 'train.class_weights' needs one weight per class "
                          f"({num_classes}), got {len(t.class_weights)}")


@dataclass
class Built:
    """One rank's run, before any round: what the round loop works with."""

    cfg: Config
    rank: int
    world_size: int
    device: torch.device
    data: Dataset
    partition: Partition
    num_samples: np.ndarray      # n_k of every client
    flat: FlatModel
    accel: Accel
    forward: Callable
    algo: Algorithm
    weighting: Weighting
    transforms: TransformChain
    rule: ServerRule
    host: np.ndarray             # rank of each client
    hosted: list[int]            # clients of this rank
    ctx: Context
    reports: Reports
    server: ServerParts          # the parts the server step runs, and their statistics
    num_outputs: int = 0         # the model's output width the method needs (C; FedGPS: 2C)
    run_info: dict = field(default_factory=dict)   # what ran (fedmpi.job.provenance), for the log
    frozen_digest: str = ""      # SHA-256 of the frozen parameters (the same on every rank)
    #: w^0, the exchanged part of the initial model (``eval.local_only``: each site's
    #: local-only model starts there, :mod:`fedmpi.consortium.site_models`)
    initial: torch.Tensor | None = None

    @property
    def num_clients(self) -> int:
        """K."""
        return len(self.num_samples)

    @property
    def stats(self) -> tuple[Stat, ...]:
        """The method's uplink statistics, then the transforms'."""
        return self.server.stats

    @property
    def components(self) -> list[tuple[str, Component]]:
        """Every component of the run with its checkpoint name, in start order."""
        return [("algorithm", self.algo), ("weighting", self.weighting),
                *((f"transform/{tr.name}", tr) for tr in self.transforms),
                ("rule", self.rule)]


def setup_process(cfg: Config, comm: Comm) -> tuple[torch.device, int, int]:
    """Threads per rank, the rank's device and the determinism switches; returns
    (device, node-local rank, ranks on this node)."""
    local_rank, local_size = comm.node_local()
    torch.set_num_threads(cfg.runtime.threads or default_threads(local_size)[0])
    device = resolve_device(cfg.runtime.device, local_rank)
    set_deterministic(cfg.runtime.deterministic)
    return device, local_rank, local_size


RANK_ROW_BYTES = 256   # one rank's "host\tlocal rank\tlocal size\tdevice" line


def rank_table(comm: Comm, device: torch.device, local_rank: int,
               local_size: int) -> dict[str, np.ndarray] | None:
    """Collective: where every process runs, on rank 0 (None elsewhere) -- the log's
    ``ranks/`` group: ``host`` (hostname), ``local_rank`` and ``local_size`` (MPI's
    shared-memory node split) and ``device``, one entry per world rank; with silos of
    several ranks (``runtime.ranks_per_silo``) also ``silo``, the federation rank each
    process serves (0: the aggregator)."""
    line = f"{socket.gethostname()}\t{local_rank}\t{local_size}\t{device}\t{comm.rank}".encode()
    row = np.zeros(RANK_ROW_BYTES, dtype=np.uint8)
    row[: min(len(line), RANK_ROW_BYTES - 1)] = np.frombuffer(line[: RANK_ROW_BYTES - 1], np.uint8)
    rows = np.zeros((comm.world_size, RANK_ROW_BYTES), dtype=np.uint8) if comm.rank == 0 else None
    comm.gather_processes(row, rows, what="rank table Gather")
    if rows is None:
        return None
    fields = [bytes(r).rstrip(b"\0").decode(errors="replace").split("\t") for r in rows]
    table = {"host": np.array([f[0] for f in fields], dtype=object),
             "local_rank": np.array([int(f[1]) for f in fields], dtype=np.int64),
             "local_size": np.array([int(f[2]) for f in fields], dtype=np.int64),
             "device": np.array([f[3] for f in fields], dtype=object)}
    if comm.world_size != comm.size:
        table["silo"] = np.array([int(f[4]) for f in fields], dtype=np.int64)
    return table


def build(cfg: Config, comm: Comm, plan: Callable[[int], np.ndarray],
          code: UserCode | None = None) -> Built:
    """Build this rank; ``plan(t)`` is the participant mask of round t (for the context);
    ``code``: objects given to :func:`fedmpi.run` in place of the config's names."""
    code = code or UserCode()
    rank, size = comm.rank, comm.size
    device, local_rank, local_size = setup_process(cfg, comm)
    ranks = rank_table(comm, device, local_rank, local_size)
    if ranks is not None:   # rank 0 names a missing rank's host (CommTimeout)
        comm.hosts = [str(h) for h in ranks["host"]]
    K = cfg.data.num_clients
    host = client_hosts(K, size)
    hosted = [k for k in range(K) if host[k] == rank]
    # pooled data partitioned identically on every rank (= `fedmpi partition`), or
    # silo-local: a rank reads only its clients' silos; n_k of all clients arrive as
    # metadata (fedmpi.data.silos)
    local = build_local(cfg, comm, hosted, rank == 0, code.data, needs=code.data_needs(cfg))
    comm.roll_call("loading its data")   # a slow rank is named (runtime.setup_timeout)
    data, partition = local.data.to(device), local.partition
    num_samples = np.asarray(local.num_samples, dtype=np.int64)
    num_samples.setflags(write=False)

    code.check(cfg)   # the components' rules, also for those given by import path
    torch.manual_seed(cfg.seed)   # every rank builds the same initial model
    algo_class = code.algorithm_class(cfg)
    check_training_keys(cfg, algo_class, data.num_classes)
    with blame("algorithm.name", algo_class):
        outputs = algo_class.spec_for(cfg).num_outputs(data.num_classes)  # FedGPS: 2C
    spec = model_spec(cfg, code.model)

    def make() -> torch.nn.Module:
        return build_model(spec, data.input_shape, outputs, cfg.model.norm)

    check_fits(comm, make)   # too large: one line before anything model-sized is allocated
    model = make()
    with blame("algorithm.name", algo_class):   # parameters that never leave their site
        personal = algo_class.personal_names(cfg, model)
    flat = FlatModel(model, device, personal=personal)
    preprocessing.attach(flat.model, preprocessing.describe(data))   # saved with every model file
    frozen_digest = same_frozen(comm, flat)
    accel = Accel.from_config(cfg.runtime, device)
    forward = accel.wrap(flat.model)   # compiled once, shared by training and evaluation

    with blame("algorithm.name", algo_class):
        algo = algo_class(cfg, flat, K)
    with blame("aggregation.weighting", code.weighting or cfg.aggregation.weighting):
        weighting = code.build_weighting(cfg, num_samples)
    with blame("transforms", None):
        transforms = build_transforms(cfg)
    rule_cls = code.rule_class(cfg)
    with blame("aggregation.rule", rule_cls):
        rule = build_rule(cfg, rule_cls)
    reports = Reports(enabled=rank == 0, rank=rank)
    for name, column in (ranks or {}).items():
        reports.reporter("ranks").static(f"ranks/{name}", column)

    def broadcast(buf: np.ndarray, what: str = "method Bcast") -> None:
        comm.broadcast(buf, what=what)

    eval_logits = algo_class.spec_for(cfg).eval_logits(data.num_classes)

    def test(state: torch.Tensor, part: slice = slice(None),
             collect=None) -> tuple[float, float, float]:
        return test_state(flat, forward, data, accel, cfg.eval.batch_size, eval_logits,
                          state, part, collect)

    scale_stat = algo_class.spec_for(cfg).delta_scale

    def delta_scale(stats) -> float:
        return float(stats[scale_stat][0]) if scale_stat is not None else 1.0

    ctx = Context(cfg=cfg, device=device, role="server" if rank == 0 else "worker", rank=rank,
                  world_size=size, num_samples=num_samples, hosted=tuple(hosted), flat=flat,
                  forward=forward, accel=accel, data=data, partition=partition, reports=reports,
                  broadcast=broadcast,
                  participants=plan, test=test,
                  client_weight=None if weighting.per_client else weighting.raw,
                  model_delta_scale=delta_scale)
    for key, part in (("algorithm.name", algo), ("aggregation.weighting", weighting),
                      *((tr.enable_key, tr) for tr in transforms), ("aggregation.rule", rule)):
        with blame(key, part):
            start(part, ctx)
            reports.declare_clients(list(part.client_values))
    transforms.client_stores(algo.client_store)   # checkpointed with the method's
    with blame("algorithm.name", algo):
        stats = (*algo.exchange().uplink, *transforms.stats())
    server = ServerParts(algo, weighting, rule, transforms, stats, num_samples)
    check_parts(cfg, server, flat.model, size)
    info = run_info(cfg, algo, weighting, list(transforms), code.model, local.files, rule)
    info["preprocessing"] = preprocessing.describe(data)
    return Built(cfg, rank, size, device, data, partition, num_samples, flat, accel, forward, algo,
                 weighting, transforms, rule, host, hosted, ctx, reports, server,
                 num_outputs=outputs, run_info=info, frozen_digest=frozen_digest,
                 initial=flat.vector.detach().clone() if cfg.eval.local_only else None)


def same_frozen(comm: Comm, flat: FlatModel) -> str:
    """Collective where the model has frozen parameters (``requires_grad=False``): they
    never travel, so every rank must have built the same ones (the seed, the same weight
    files); refused otherwise. Returns their digest ("" without any)."""
    digest = flat.frozen_digest()
    if digest and comm.size > 1:
        mine = int(digest[:15], 16)   # 60 bits: an int64 for one Allreduce each way
        if comm.max_int(mine) != -comm.max_int(-mine):
            raise ConfigError(f"config key 'model.name': the model's {flat.frozen.numel():,} "
                              "frozen parameters (requires_grad=False) differ between ranks; "
                              "they never travel, so every rank must build them identically "
                              "(from the seed or the same weight files)")
    return digest


def check_parts(cfg: Config, server: ServerParts, model: torch.nn.Module, world_size: int) -> None:
    """The rules that span the built parts, derived from their declarations: each
    transform's ``validate``; a per-client weighting or rule needs ``delta`` as a weighted
    statistic; a ``sums_only`` stage (secure aggregation) refuses ``client`` statistics,
    which reach rank 0 one client at a time."""
    stages = server.stages
    parts = RunParts(cfg, server.algo, server.weighting, server.rule, tuple(stages),
                     server.stats, model, world_size)
    for tr in stages:
        with blame(tr.enable_key, tr):
            tr.validate(parts)
    if not any(s.name == "delta" and s.combine == "weighted" for s in server.stats):
        for key, part in (("aggregation.weighting", server.weighting),
                          ("aggregation.rule", server.rule)):
            if part.per_client:
                raise ConfigError(f"config key {key!r}: {part.name!r} needs the 'delta' uplink of "
                                  f"algorithm {cfg.algorithm.name!r} as a weighted statistic")
    private = next((tr for tr in stages if tr.sums_only), None)
    per_client = [s.name for s in server.stats if s.combine == "client"]
    if private is not None and per_client:
        raise ConfigError(f"config keys {private.enable_key!r} and 'algorithm.name': "
                          f"{cfg.algorithm.name!r} sends per-client statistics "
                          f"({', '.join(per_client)}) to rank 0")
