"""Do the methods help? Each paper's claimed direction over its baseline on the embedded data
(issue 39), paired by seed.

    python bench/paper_direction.py [--suite direction|issue|ablation|search|natural|all]
                                    [--seeds 0 1 2] [--quick] [--out runs/paper_direction]
                                    [--only KEY ...] [--summary-only] [--rekey-cache]

A *suite* is a list of comparisons; a comparison is one setting (a config plus ``--set``
overrides) with a baseline arm and one or more method arms. Every (arm, seed) is one
in-process ``fedmpi.run`` at world size 1 (results do not depend on the world size) with
``runtime.threads=1``, run sequentially. Each run's curves are cached as
``<out>/cache/<hash>.json``. The hash covers every key of the resolved configuration whose
value differs from its default (the name left out), so an interrupted sweep resumes where it
stopped, a changed setting is re-run, one setting reached from two suites runs once, and a
key that fedmpi adds later with a default does not invalidate the cache (a changed *default*
is not seen: re-run a spot check after such a change). ``--rekey-cache`` renames the entries
of an older cache (keyed by the full resolved configuration) from the config and overrides
each one stores. ``--quick`` caps every run at 3 rounds and the first seed, into
``<out>/quick`` (a smoke test of the whole pipeline, not a measurement).

Per comparison and arm, over the seeds: final test accuracy, the mean of the last 5 rounds
("last-5", the curves oscillate), and the difference of last-5 to the baseline *paired by
seed* (mean ± sample std, ddof = 1) with the number of seeds where the arm is better.
FedLAGC's test accuracy is the mean over its resource levels (as the runtime logs it).
A comparison compares test accuracy unless it names another ``/rounds`` curve
(``metric``: ``auroc``, ``test_loss`` with ``lower_better``); a cache entry keeps every
curve of :data:`CURVES`, so one run serves every metric (an older entry with accuracy only
is re-run for another metric). The ``natural`` suite is medpar's 21 hospitals
(``pip install 'fedmpi[institutions]'``).

Writes ``<out>/<suite>.csv`` (one row per comparison × arm), ``<out>/<suite>_runs.csv``
(one row per run), ``<out>/<suite>.png`` (paired Δ last-5 with one dot per seed), prints
a markdown table and, last, one JSON object with every number.
"""
from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QUICK_ROUNDS = 3
LAST = 5
COMMON = ("runtime.threads=1", "runtime.progress=false", "runtime.device=cpu")
#: the /rounds curves a cache entry keeps (a comparison's ``metric`` is one of them)
CURVES = ("test_accuracy", "auroc", "balanced_accuracy", "macro_f1", "test_loss")


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    sets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Comparison:
    """One setting: ``config`` + ``sets`` for every arm, the baseline's own ``base``
    overrides, and each method arm's."""

    key: str
    method: str
    setting: str
    config: str
    sets: tuple[str, ...]
    base: Arm
    arms: tuple[Arm, ...]
    also: tuple[tuple[str, str], ...] = ()   # extra (arm, other arm) pairs, e.g. FedLAGC vs FIARSE
    metric: str = "test_accuracy"            # the /rounds curve compared (e.g. auroc)
    lower_better: bool = False               # True for test_loss: "better" counts Δ < 0


def cfg(name: str) -> str:
    return str(ROOT / "configs" / name)


# ----------------------------------------------------------------------------- settings
# The issue's setting: the quickstart's data (digits, Dir(0.5), 10 silos, 5 per round,
# 2 local epochs, batch 32, lr 0.02, momentum 0.5), 10 rounds.
QS = ("train.rounds=10",)
FEDAVG = Arm("fedavg", "FedAvg", ("algorithm.name=fedavg", "aggregation.weighting=samples"))
FEDGPS = Arm("fedgps", "FedGPS", ("algorithm.name=fedgps",))
GPS = "algorithm.fedgps."


def gps(key: str, label: str, *sets: str) -> Arm:
    return Arm(key, label, ("algorithm.name=fedgps", *sets))


ISSUE = [
    Comparison("fedvg_qs", "FedVG", "quickstart: digits Dir(0.5), 10 rounds", cfg("quickstart.yaml"),
               QS, FEDAVG, (Arm("fedvg", "FedVG", ("aggregation.weighting=fedvg",)),)),
    Comparison("fedgps_qs", "FedGPS", "quickstart: digits Dir(0.5), 10 rounds",
               cfg("quickstart.yaml"), QS, FEDAVG, (FEDGPS,)),
    Comparison("ecgr_qs", "ECGR", "quickstart: digits Dir(0.5), 10 rounds", cfg("quickstart.yaml"),
               QS, FEDAVG, (Arm("ecgr", "ECGR (on FedAvg)", ("ecgr.enabled=true",)),)),
    Comparison("fedlagc_qs", "FedLAGC", "fedlagc_digits: Dir(0.5), levels 1..1/64, 10 rounds",
               cfg("fedlagc_digits.yaml"), ("train.rounds=10",),
               Arm("heterofl", "HeteroFL", ("algorithm.name=heterofl",)),
               (Arm("fedlagc", "FedLAGC", ("algorithm.name=fedlagc",)),)),
]

# FedGPS ablation (item 1): each part switched off or changed in turn.
_GPS_ARMS = (
    FEDGPS,
    gps("paper", "preset: paper", GPS + "preset=paper"),
    gps("authors", "preset: authors", GPS + "preset=authors"),
    gps("static", "static only (dynamic off)", GPS + "dynamic=false"),
    gps("dynamic", "dynamic only (static off)", GPS + "static=false"),
    gps("nol1", "λ1 = 0 (no real/surrogate SupCon)", GPS + "lambda1=0"),
    gps("nows", "surrogate-only SupCon = 0", GPS + "surrogate_supcon=0"),
    gps("nol2", "λ2 = 0 (prototype path off)", GPS + "lambda2=0"),
    gps("ceonly", "surrogate CE only (λ1 = w_s = λ2 = 0)", GPS + "lambda1=0",
        GPS + "surrogate_supcon=0", GPS + "lambda2=0"),
    gps("ds20", "D^s 20 per class", GPS + "surrogate_per_class=20"),
    gps("ds1000", "D^s 1000 per class", GPS + "surrogate_per_class=1000"),
    gps("sb32", "surrogate batch 32 (= real batch)", GPS + "surrogate_batch=32"),
    gps("lg005", "λg = 0.05", GPS + "lambda_g=0.05"),
    gps("against", "sign: against (Def. 4.5)", GPS + "sign=against"),
    gps("uniform", "uniform server weights (Alg. 1)", "aggregation.weighting=uniform"),
    gps("lg01", "λg = 0.1", GPS + "lambda_g=0.1"),
    gps("pts", "‖δ‖ = Σ per-tensor L2 (authors' code)", GPS + "norm=per_tensor_sum"),
)
# Tabular silos: breast_cancer, 6 silos, MLP. The static objective needs image inputs
# (Def. 4.1's surrogate is image-like), so only the dynamic half runs there; the silo
# files are replaced by the identical pooled Dirichlet partition (fedmpi/data/export.py).
TAB = ("data.partition.method=dirichlet",)
_TAB_ARMS = (
    gps("dynamic", "FedGPS dynamic (defaults)", GPS + "static=false"),
    gps("dyn_paper", "dynamic, preset: paper", GPS + "static=false", GPS + "preset=paper"),
    gps("dyn_authors", "dynamic, preset: authors", GPS + "static=false", GPS + "preset=authors"),
    gps("dyn_against", "dynamic, sign: against", GPS + "static=false", GPS + "sign=against"),
    gps("dyn_lg005", "dynamic, λg = 0.05", GPS + "static=false", GPS + "lambda_g=0.05"),
    gps("dyn_lg2", "dynamic, λg = 2", GPS + "static=false", GPS + "lambda_g=2"),
)
ABLATION = [
    Comparison("gps_abl_digits", "FedGPS", "quickstart: digits Dir(0.5), 10 rounds",
               cfg("quickstart.yaml"), QS, FEDAVG, _GPS_ARMS),
    Comparison("gps_abl_digits_gn", "FedGPS", "quickstart with GroupNorm CNN (no BN statistics)",
               cfg("quickstart.yaml"), (*QS, "model.norm=gn"), FEDAVG,
               (FEDGPS, gps("static", "static only (dynamic off)", GPS + "dynamic=false"))),
    Comparison("gps_abl_tabular", "FedGPS", "tabular_silos: breast_cancer, 6 silos, MLP, 20 rounds",
               cfg("tabular_silos.yaml"), TAB, FEDAVG, _TAB_ARMS),
]

# Candidate settings for item 2 (every one tried is listed, whatever it showed). Seeds vary
# the run seed *and* the partition ({seed} in an override).
PSEED = "data.partition.seed={seed}"
FEDVG = Arm("fedvg", "FedVG", ("aggregation.weighting=fedvg",))
ECGR_ON = Arm("ecgr", "ECGR", ("ecgr.enabled=true",))
ECGR_OFF = Arm("plain", "no ECGR", ("ecgr.enabled=false",))
FEDLAGC = Arm("fedlagc", "FedLAGC", ("algorithm.name=fedlagc",))
HETEROFL = Arm("heterofl", "HeteroFL", ("algorithm.name=heterofl",))
FIARSE = Arm("fiarse", "FIARSE", ("algorithm.name=fiarse",))
VS_FIARSE = (("fedlagc", "fiarse"),)   # the paper's strongest baseline
FLIP = ("adversary.kind=label_flip", "adversary.clients=[0,1,2]")
SEARCH: list[Comparison] = [
    # FedVG: heterogeneity and label-flipping silos (the validation score should down-weight them)
    Comparison("fedvg_a005", "FedVG", "fedvg_digits: Dir(0.05), 20 rounds", cfg("fedvg_digits.yaml"),
               (), FEDAVG, (FEDVG,)),
    Comparison("fedvg_a01", "FedVG", "fedvg_digits at Dir(0.1), 20 rounds", cfg("fedvg_digits.yaml"),
               ("data.partition.alpha=0.1",), FEDAVG, (FEDVG,)),
    Comparison("fedvg_shards", "FedVG", "quickstart, shards (2 classes per silo), 20 rounds",
               cfg("quickstart.yaml"), ("data.partition.method=shards", "train.rounds=20"),
               FEDAVG, (FEDVG,)),
    Comparison("fedvg_flip", "FedVG", "quickstart Dir(0.5), silos 0-2 flip labels, 20 rounds",
               cfg("quickstart.yaml"), (*FLIP, "train.rounds=20"), FEDAVG, (FEDVG,)),
    # FedGPS: the paper's protocol scaled (Dir(0.1), 50 % sampling, E = 1, lr 0.01/0.9, 30 rounds)
    Comparison("fedgps_a01", "FedGPS", "fedgps_digits: Dir(0.1), 30 rounds", cfg("fedgps_digits.yaml"),
               (PSEED,), FEDAVG,
               (FEDGPS, gps("lg005", "FedGPS, λg = 0.05", GPS + "lambda_g=0.05"),
                gps("pts", "FedGPS, ‖δ‖ per-tensor sum", GPS + "norm=per_tensor_sum"),
                gps("static", "FedGPS static only", GPS + "dynamic=false"))),
    Comparison("fedgps_shards", "FedGPS", "fedgps_digits, shards (2 classes per silo), 30 rounds",
               cfg("fedgps_digits.yaml"), (PSEED, "data.partition.method=shards"), FEDAVG,
               (FEDGPS, gps("lg005", "FedGPS, λg = 0.05", GPS + "lambda_g=0.05"))),
    # ECGR: extreme label skew, many local steps
    Comparison("ecgr_a001", "ECGR", "ecgr_digits: LeNet, Dir(0.01), 30 rounds", cfg("ecgr_digits.yaml"),
               (), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_a01", "ECGR", "ecgr_digits at Dir(0.1), 30 rounds", cfg("ecgr_digits.yaml"),
               ("data.partition.alpha=0.1",), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_shards_e5", "ECGR", "quickstart CNN, shards, 5 local epochs, 20 rounds",
               cfg("quickstart.yaml"), ("data.partition.method=shards", "train.local_epochs=5",
                                        "train.rounds=20"), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_prox_a001", "ECGR", "ecgr_digits with FedProx (μ 0.1), Dir(0.01), 30 rounds",
               cfg("ecgr_digits.yaml"), ("algorithm.name=fedprox",), ECGR_OFF, (ECGR_ON,)),
    # FedLAGC: the paper's skewed system {1-1/4-1/16-1/64}-{2-4-6-8}; the paper's strongest
    # baseline is FIARSE
    Comparison("fedlagc_a05", "FedLAGC", "fedlagc_digits: Dir(0.5), 30 rounds",
               cfg("fedlagc_digits.yaml"), (), HETEROFL, (FEDLAGC, FIARSE), also=VS_FIARSE),
    Comparison("fedlagc_a01", "FedLAGC", "fedlagc_digits at Dir(0.1), 30 rounds",
               cfg("fedlagc_digits.yaml"), ("data.partition.alpha=0.1", "data.partition.min_size=10"),
               HETEROFL, (FEDLAGC, FIARSE), also=VS_FIARSE),
    # second round of candidates, after the first showed no direction for ECGR, FedGPS and
    # FedLAGC-vs-FIARSE
    Comparison("ecgr_a001_e3", "ECGR", "ecgr_digits, Dir(0.01), 3 local epochs, 30 rounds",
               cfg("ecgr_digits.yaml"), ("train.local_epochs=3",), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_a005", "ECGR", "ecgr_digits at Dir(0.05), 30 rounds", cfg("ecgr_digits.yaml"),
               ("data.partition.alpha=0.05",), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_a001_lr001", "ECGR", "ecgr_digits, Dir(0.01), lr 0.01, 30 rounds",
               cfg("ecgr_digits.yaml"), ("train.lr=0.01",), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_qs_a01", "ECGR", "quickstart CNN, Dir(0.1), momentum 0.9, 20 rounds",
               cfg("quickstart.yaml"), ("data.partition.alpha=0.1", "data.partition.min_size=10",
                                        "train.momentum=0.9", "train.rounds=20"),
               ECGR_OFF, (ECGR_ON,)),
    Comparison("fedgps_xdev", "FedGPS", "fedgps_digits cross-device: 50 clients, 10 % sampling, "
               "Dir(0.1), 30 rounds", cfg("fedgps_digits.yaml"),
               (PSEED, "data.num_clients=50", "train.clients_per_round=5", "data.partition.min_size=5"),
               FEDAVG, (FEDGPS, gps("lg005", "FedGPS, λg = 0.05", GPS + "lambda_g=0.05"),
                        gps("static", "FedGPS static only", GPS + "dynamic=false"))),
    Comparison("fedgps_a005_r60", "FedGPS", "fedgps_digits at Dir(0.05), 60 rounds",
               cfg("fedgps_digits.yaml"), (PSEED, "data.partition.alpha=0.05", "train.rounds=60"),
               FEDAVG, (FEDGPS, gps("lg005", "FedGPS, λg = 0.05", GPS + "lambda_g=0.05"),
                        gps("static", "FedGPS static only", GPS + "dynamic=false"))),
    Comparison("ecgr_a001_lr001_r60", "ECGR", "ecgr_digits, Dir(0.01), lr 0.01 halved every 20, "
               "60 rounds", cfg("ecgr_digits.yaml"),
               ("train.lr=0.01", "train.lr_decay_every=20", "train.rounds=60"), ECGR_OFF, (ECGR_ON,)),
    Comparison("ecgr_a001_lr002", "ECGR", "ecgr_digits, Dir(0.01), lr 0.02, 30 rounds",
               cfg("ecgr_digits.yaml"), ("train.lr=0.02",), ECGR_OFF, (ECGR_ON,)),
    Comparison("fedlagc_iid", "FedLAGC", "fedlagc_digits, IID, 30 rounds", cfg("fedlagc_digits.yaml"),
               ("data.partition.method=iid",), HETEROFL, (FEDLAGC, FIARSE), also=VS_FIARSE),
    Comparison("fedlagc_5level", "FedLAGC", "fedlagc_digits, 5 levels {1,16/25,9/25,4/25,1/25}"
               "-{1,2,3,4,10}, 30 rounds", cfg("fedlagc_digits.yaml"),
               ("system.levels=[1.0,0.64,0.36,0.16,0.04]", "system.allocation=[1,2,3,4,10]"),
               HETEROFL, (FEDLAGC, FIARSE), also=VS_FIARSE),
]
# The final table (item 2): per method the setting in which its paper's direction shows on
# seeds 0-2 *and* on the held-out seeds 3-5 (docs/fidelity.md), each a config in configs/.
NOGC = Arm("fedlagc_nogc", "FedLAGC w/o GC", ("algorithm.name=fedlagc",
                                              "algorithm.fedlagc.correction=false"))
DIRECTION: list[Comparison] = [
    Comparison("fedvg_skew", "FedVG", "configs/fedvg_digits.yaml: Dir(0.05), 20 rounds",
               cfg("fedvg_digits.yaml"), (), FEDAVG, (FEDVG,)),
    Comparison("fedvg_label_flip", "FedVG", "configs/fedvg_digits_label_flip.yaml: Dir(0.5), "
               "silos 0-2 flip labels, 20 rounds", cfg("fedvg_digits_label_flip.yaml"), (),
               FEDAVG, (FEDVG,)),
    Comparison("fedgps_skew", "FedGPS", "configs/fedgps_digits_skewed.yaml: Dir(0.05), 60 rounds, "
               "λg 0.05", cfg("fedgps_digits_skewed.yaml"), (PSEED,), FEDAVG,
               (FEDGPS, gps("lg05", "FedGPS, paper's λg = 0.5", GPS + "lambda_g=0.5"))),
    Comparison("fedgps_xdev", "FedGPS", "configs/fedgps_digits_cross_device.yaml: 50 clients, "
               "10 % sampling, Dir(0.1), 30 rounds, λg 0.05", cfg("fedgps_digits_cross_device.yaml"),
               (PSEED,), FEDAVG,
               (FEDGPS, gps("lg05", "FedGPS, paper's λg = 0.5", GPS + "lambda_g=0.5"))),
    Comparison("ecgr_low_lr", "ECGR", "configs/ecgr_digits_low_lr.yaml: LeNet, Dir(0.01), lr 0.01, "
               "30 rounds", cfg("ecgr_digits_low_lr.yaml"), (), ECGR_OFF, (ECGR_ON,)),
    Comparison("fedlagc_skew", "FedLAGC", "configs/fedlagc_digits.yaml: Dir(0.5), levels "
               "{1,1/4,1/16,1/64}-{2,4,6,8}, 30 rounds", cfg("fedlagc_digits.yaml"), (),
               HETEROFL, (FEDLAGC, FIARSE, NOGC),
               also=(("fedlagc", "fiarse"), ("fedlagc", "fedlagc_nogc"))),
]

# Natural silos (issue 50, item 4): medpar's 21 hospitals as they are (no synthetic split),
# the MLP; 66.4 % of the test stays survived (the majority rate), so each setting is also
# compared in AUROC (0.5 = no skill). FedLAGC's submodels log accuracy only (AUROC is NaN),
# and the paper's levels 1/16 and 1/64 are below the MLP's 642 always-kept parameters of
# 4,738, so its levels here are {1, 1/2, 1/4}, 7 hospitals each.
MEDPAR = cfg("medpar_hospitals.yaml")
MEDPAR_LAGC = ("system.levels=[1.0,0.5,0.25]", "system.allocation=[7,7,7]", "train.rounds=20",
               "train.clients_per_round=10")
_VG_FLIP = "configs/medpar_hospitals.yaml: 21 hospitals, hospitals 0-2 flip labels, 30 rounds"
_VG_CLEAN = "configs/medpar_hospitals.yaml: 21 hospitals, 30 rounds"
_LAGC = "configs/medpar_hospitals.yaml, levels {1,1/2,1/4}-{7,7,7}, 10 per round, 20 rounds"
NATURAL: list[Comparison] = [
    Comparison("medpar_fedvg_flip", "FedVG", _VG_FLIP + " (accuracy)", MEDPAR, FLIP,
               FEDAVG, (FEDVG,)),
    Comparison("medpar_fedvg_flip_auroc", "FedVG", _VG_FLIP + " (AUROC)", MEDPAR, FLIP,
               FEDAVG, (FEDVG,), metric="auroc"),
    Comparison("medpar_fedlagc", "FedLAGC", _LAGC + " (accuracy, mean over levels)", MEDPAR,
               MEDPAR_LAGC, HETEROFL, (FEDLAGC, FIARSE, NOGC),
               also=(("fedlagc", "fiarse"), ("fedlagc", "fedlagc_nogc"))),
    Comparison("medpar_fedlagc_loss", "FedLAGC", _LAGC + " (test loss ×100, mean over levels; "
               "lower is better)", MEDPAR, MEDPAR_LAGC, HETEROFL, (FEDLAGC, FIARSE, NOGC),
               also=(("fedlagc", "fiarse"), ("fedlagc", "fedlagc_nogc")), metric="test_loss",
               lower_better=True),
    Comparison("medpar_fedvg", "FedVG", _VG_CLEAN + " (accuracy)", MEDPAR, (), FEDAVG, (FEDVG,)),
    Comparison("medpar_fedvg_auroc", "FedVG", _VG_CLEAN + " (AUROC)", MEDPAR, (), FEDAVG, (FEDVG,),
               metric="auroc"),
]

SUITES: dict[str, list[Comparison]] = {"issue": ISSUE, "ablation": ABLATION, "search": SEARCH,
                                       "direction": DIRECTION, "natural": NATURAL}


# --------------------------------------------------------------------------------- runs
@dataclass
class Cell:
    comparison: Comparison
    arm: Arm
    curves: dict[int, np.ndarray] = field(default_factory=dict)


def run_sets(comp: Comparison, arm: Arm, seed: int, quick: bool) -> list[str]:
    sets = [x.format(seed=seed) for x in (*comp.sets, *arm.sets)] + [f"seed={seed}", *COMMON]
    return sets + [f"train.rounds={QUICK_ROUNDS}"] if quick else sets


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, str]:
    from fedmpi.api import resolve_config

    return {k: json.dumps(v, default=str) for k, v in _flat(resolve_config({}).to_dict()).items()}


def changed_keys(config: str, sets: list[str]) -> dict:
    """The resolved configuration's keys (dotted) whose value differs from the default, the
    run's name left out."""
    from fedmpi.api import resolve_config

    flat = _flat(resolve_config(config, sets).to_dict())
    flat.pop("name", None)
    dflt = _defaults()
    return {k: v for k, v in flat.items() if dflt.get(k) != json.dumps(v, default=str)}


def run_key(config: str, sets: list[str]) -> str:
    """Hash of the keys that differ from their defaults: the same setting reached from two
    configs or suites is one cached run, and a key added later with a default leaves it."""
    changed = json.dumps(changed_keys(config, sets), sort_keys=True, default=str)
    return hashlib.sha256(changed.encode()).hexdigest()[:16]


def rekey_cache(out: Path) -> None:
    """Rename each ``<out>/cache/*.json`` to its key under :func:`run_key`, recomputed from the
    config and overrides the entry stores (its log folder follows)."""
    moved = 0
    for path in sorted((out / "cache").glob("*.json")):
        entry = json.loads(path.read_text())
        key = run_key(entry["config"], entry["sets"])
        if key == path.stem:
            continue
        target = path.with_name(f"{key}.json")
        if target.exists():
            raise SystemExit(f"{path}: {target.name} exists (two entries, one setting)")
        entry["changed"] = changed_keys(entry["config"], entry["sets"])
        target.write_text(json.dumps(entry, default=str))
        path.unlink()
        log = out / "logs" / path.stem
        if log.is_dir() and not (out / "logs" / key).exists():
            log.rename(out / "logs" / key)
        moved += 1
    print(json.dumps({"rekeyed": moved, "cache": str(out / "cache")}))


def one_run(comp: Comparison, arm: Arm, seed: int, out: Path, quick: bool,
            run_missing: bool = True) -> Optional[np.ndarray]:
    """The curve of ``comp.metric`` of one (arm, seed): from ``<out>/cache/<key>.json``, else a
    fresh run (its log under ``<out>/logs/<key>``) unless ``run_missing`` is false."""
    sets = run_sets(comp, arm, seed, quick)
    key = run_key(comp.config, sets)
    cache = out / "cache" / f"{key}.json"
    if cache.exists():
        entry = json.loads(cache.read_text())
        if comp.metric in entry:   # an older entry holds test_accuracy only: re-run it
            return np.asarray(entry[comp.metric], dtype=float)
    if not run_missing:
        return None
    import fedmpi
    from fedmpi.log.reader import read

    t0 = time.perf_counter()
    try:
        res = fedmpi.run(comp.config, [*sets, f"name={comp.key}_{arm.key}_s{seed}"],
                         out=out / "logs" / key, overwrite=True)
    except (fedmpi.ConfigError, fedmpi.RunFailed) as exc:   # e.g. no partition for this seed
        print(json.dumps({"comparison": comp.key, "arm": arm.key, "seed": seed,
                          "failed": str(exc).splitlines()[0][:200]}), flush=True)
        return None
    rounds = read(res.log_path).rounds
    curves = {m: np.asarray(rounds[m], dtype=float).tolist() for m in CURVES if m in rounds}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"config": comp.config, "sets": sets, "seed": seed,
                                 "changed": changed_keys(comp.config, sets),
                                 "seconds": round(time.perf_counter() - t0, 1),
                                 **curves}, default=str))
    acc = np.asarray(curves.get(comp.metric, [np.nan]), dtype=float)
    print(json.dumps({"comparison": comp.key, "arm": arm.key, "seed": seed,
                      "metric": comp.metric, "final": round(float(acc[-1]), 4),
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return acc


def last_mean(acc: np.ndarray) -> float:
    return float(np.mean(acc[-min(LAST, acc.size):]))


def paired_row(cell: Cell, ref: Cell, seeds: list[int], is_ref: bool) -> dict:
    """Final and last-5 of ``cell`` over ``seeds``; its last-5 minus ``ref``'s, paired by seed."""
    fin = np.array([cell.curves[s][-1] for s in seeds]) * 100
    last = np.array([last_mean(cell.curves[s]) for s in seeds]) * 100
    d = last - np.array([last_mean(ref.curves[s]) for s in seeds]) * 100
    return {"comparison": cell.comparison.key, "method": cell.comparison.method,
            "setting": cell.comparison.setting, "arm": cell.arm.label,
            "baseline": ref.arm.label, "is_baseline": is_ref, "seeds": len(seeds),
            "final_mean": fin.mean(), "final_std": std(fin),
            "last5_mean": last.mean(), "last5_std": std(last),
            "delta_last5_mean": 0.0 if is_ref else d.mean(),
            "delta_last5_std": 0.0 if is_ref else std(d),
            "seeds_better": 0 if is_ref else int(((-d if cell.comparison.lower_better else d)
                                                   > 0).sum()),
            "metric": cell.comparison.metric, "lower_better": cell.comparison.lower_better,
            "per_seed_delta": [] if is_ref else [round(float(v), 2) for v in d]}


def summarize(cells: list[Cell], base: Cell, also: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """One row per arm against the baseline, then one per ``also`` pair."""
    def common(*cs: Cell) -> list[int]:
        return sorted(set.intersection(*(set(c.curves) for c in cs)))

    rows = [paired_row(c, base, common(c, base), c is base) for c in [base, *cells]
            if common(c, base)]   # an arm with no cached or finished run is left out
    by_key = {c.arm.key: c for c in cells}
    for a, b in also:
        if a in by_key and b in by_key and common(by_key[a], by_key[b]):
            rows.append(paired_row(by_key[a], by_key[b], common(by_key[a], by_key[b]), False))
    return rows


def std(v: np.ndarray) -> float:
    return float(np.std(v, ddof=1)) if v.size > 1 else 0.0


def markdown(rows: list[dict]) -> str:
    lines = ["| method | setting | arm | final | last-5 mean | Δ last-5 vs baseline | seeds better |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["is_baseline"]:
            delta, better = "–", "–"
        else:
            delta = f"{r['delta_last5_mean']:+.2f} ± {r['delta_last5_std']:.2f} vs {r['baseline']}"
            better = f"{r['seeds_better']}/{r['seeds']}"
        lines.append(f"| {r['method']} | {r['setting']} | {r['arm']} | "
                     f"{r['final_mean']:.2f} ± {r['final_std']:.2f} | "
                     f"{r['last5_mean']:.2f} ± {r['last5_std']:.2f} | {delta} | {better} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    arms = [r for r in rows if not r["is_baseline"]]
    if not arms:
        return
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(arms) + 1.5))
    y = np.arange(len(arms))[::-1]
    for yi, r in zip(y, arms):
        ax.scatter(r["per_seed_delta"], [yi] * len(r["per_seed_delta"]), s=14, color="0.5", zorder=2)
        better = -r["delta_last5_mean"] if r["lower_better"] else r["delta_last5_mean"]
        ax.errorbar(r["delta_last5_mean"], yi, xerr=r["delta_last5_std"], fmt="o",
                    color="C0" if better > 0 else "C3", zorder=3)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([f"{r['method']}: {r['arm']} vs {r['baseline']} [{r['comparison']}]"
                        for r in arms], fontsize=7)
    ax.set_xlabel("Δ last-5 vs baseline, ×100, paired by seed (test accuracy unless the "
                  "setting names its metric;\nblue: the arm is better)", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_suite(name: str, comps: list[Comparison], args, out: Path) -> list[dict]:
    rows: list[dict] = []
    per_run: list[list] = []
    for comp in comps:
        if args.only and comp.key not in args.only:
            continue
        base = Cell(comp, comp.base)
        cells = [Cell(comp, a) for a in comp.arms]
        for seed in args.seeds:
            for cell in [base, *cells]:
                acc = one_run(comp, cell.arm, seed, out, args.quick, not args.summary_only)
                if acc is not None:
                    cell.curves[seed] = acc
                    per_run.append([comp.key, cell.arm.key, seed, f"{acc[-1]:.4f}",
                                    f"{last_mean(acc):.4f}", f"{np.nanmax(acc):.4f}", acc.size])
        if base.curves:
            rows += summarize(cells, base, comp.also)
    if not rows:
        return rows
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    with open(out / f"{name}_runs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["comparison", "arm", "seed", "final", "last5", "best", "rounds"])
        w.writerows(per_run)
    plot(rows, out / f"{name}.png", f"paper_direction: {name} (seeds {args.seeds})")
    print(f"\n## {name}\n\n" + markdown(rows))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="direction", choices=[*SUITES, "all"])
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds, first seed")
    ap.add_argument("--out", default=str(ROOT / "runs" / "paper_direction"))
    ap.add_argument("--only", nargs="+", default=None, help="comparison keys to run")
    ap.add_argument("--summary-only", action="store_true", help="tables from the cache only")
    ap.add_argument("--rekey-cache", action="store_true",
                    help="rename an older cache's entries to the current keys, then stop")
    args = ap.parse_args()
    if args.rekey_cache:
        rekey_cache(Path(args.out))
        return
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    out = Path(args.out) / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    result = {n: run_suite(n, SUITES[n], args, out) for n in names}
    print(json.dumps({"seeds": args.seeds, "quick": args.quick, "suites": result}, default=float))


if __name__ == "__main__":
    main()
