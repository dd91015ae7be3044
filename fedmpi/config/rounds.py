"""``round.*``: the round policy's keys (:mod:`fedmpi.round.modes`) and their rules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedmpi.config.params import CopyOnRead, param
from fedmpi.errors import ConfigError

if TYPE_CHECKING:
    from fedmpi.config.core import Config

__all__ = ["RoundConfig", "round_checks"]


@dataclass(frozen=True)
class RoundConfig(CopyOnRead):
    """``round.*``: what a round waits for (docs/rounds.md)."""

    mode: str = param("sync", "sync = every participant of round t trains from θ^t and the "
                      "step waits for all of them; deadline = the round closes at "
                      "round.deadline seconds or when all reported, late updates dropped or "
                      "carried; buffered = clients train continuously, the server applies "
                      "a step after round.buffer arrivals (1 = FedAsync)",
                      choices=("sync", "deadline", "buffered"))
    clock: str = param("wall", "wall = measured time (a deployment); virtual = each job "
                       "takes slowdown_k x samples x round.sample_seconds simulated seconds, "
                       "so arrivals do not depend on the machine's load (research)",
                       choices=("wall", "virtual"))
    deadline: float | None = param(None, "round.mode deadline: seconds after θ is sent at "
                                   "which a round closes (virtual seconds on the virtual "
                                   "clock)", gt=0)
    min_updates: int = param(1, "round.mode deadline: a round never closes with fewer "
                             "updates; it waits for them up to runtime.round_timeout", ge=1)
    time_budget: bool = param(False, "round.mode deadline: each participant trains as many "
                              "local steps as fit before the deadline (virtual clock: "
                              "floor(deadline / (slowdown_k x batch_size x "
                              "round.sample_seconds)); wall clock: until its next step would "
                              "end after the deadline), at least 1, instead of "
                              "train.local_steps/local_epochs; FedNova's normalisation keeps "
                              "unequal step counts from biasing the aggregate")
    late: str = param("drop", "round.mode deadline: an update that misses its round is "
                      "dropped, or carried into the next step with its staleness weight",
                      choices=("drop", "carry"))
    buffer: int = param(1, "round.mode buffered: arrivals per server step (1 = FedAsync)",
                        ge=1)
    concurrency: int | None = param(None, "round.mode buffered: clients training at once; "
                                    "null = train.clients_per_round", ge=1)
    staleness: str = param("constant", "weight s(tau) of an update tau steps old: constant "
                           "1, polynomial (tau+1)^-a, hinge 1 up to b then 1/(a(tau-b)+1)",
                           choices=("constant", "polynomial", "hinge"))
    staleness_a: float = param(0.5, "exponent (polynomial) or slope (hinge) of round.staleness",
                               ge=0)
    staleness_b: int = param(4, "knee of the hinge staleness function", ge=0)
    max_staleness: int | None = param(None, "drop an update more than this many steps old; "
                                      "null = never", ge=0)
    sample_seconds: float = param(1e-3, "round.clock virtual: simulated seconds per training "
                                  "sample at slowdown 1", gt=0)


#: methods and settings a non-synchronous round cannot serve, checked by :func:`round_checks`
def round_checks(cfg: Config) -> None:
    """``round.*`` against the rest; ConfigError naming both keys on the first conflict."""
    r = cfg.round
    slow = cfg.system.slowdown
    if slow is not None and len(slow) != cfg.data.num_clients:
        raise ConfigError(f"config key 'system.slowdown' must have one factor per client "
                          f"(data.num_clients = {cfg.data.num_clients}), got {len(slow)}")
    if r.time_budget and r.mode != "deadline":
        raise ConfigError(f"config key 'round.time_budget' needs round.mode 'deadline' (its "
                          f"budget is the round's deadline), got round.mode {r.mode!r}")
    if r.mode == "sync":
        if cfg.runtime.replay is not None:
            raise ConfigError("config key 'runtime.replay' needs round.mode deadline or "
                              "buffered (a synchronous run has no arrival order to replay)")
        return
    if r.mode == "deadline" and r.deadline is None:
        raise ConfigError("config key 'round.deadline' must be set with round.mode 'deadline'")
    m = cfg.train.clients_per_round or cfg.data.num_clients
    if r.mode == "deadline" and r.min_updates > m:
        raise ConfigError(f"config key 'round.min_updates' must be <= train.clients_per_round "
                          f"({m}), got {r.min_updates}")
    if r.mode == "buffered":
        c = r.concurrency or m
        if c > cfg.data.num_clients:
            raise ConfigError(f"config key 'round.concurrency' must be <= data.num_clients "
                              f"({cfg.data.num_clients}), got {c}")
        if r.buffer > c:
            raise ConfigError(f"config key 'round.buffer' must be <= round.concurrency ({c}), "
                              f"got {r.buffer}")
    refused = (
        ("privacy.secure_aggregation", cfg.privacy.secure_aggregation,
         "masks are drawn for a cohort fixed before training"),
        ("privacy.dp.level", cfg.privacy.dp.level != "none",
         "its accountant assumes rounds of uniformly sampled participants"),
        ("eval.where", cfg.eval.where != "server", "a per-site evaluation needs every rank at "
         "one collective"),
        ("eval.cross_site", cfg.eval.cross_site, "it trains every site after the last round"),
        ("runtime.ranks_per_silo", cfg.runtime.ranks_per_silo > 1,
         "a silo's ranks train each batch together"),
    )
    for key, on, why in refused:
        if on:
            raise ConfigError(f"config key {key!r} does not compose with round.mode "
                              f"{r.mode!r} ({why}); set round.mode: sync or change {key}")
