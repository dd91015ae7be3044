"""Where does FedLAGC's gap to FIARSE come from? (issue 50, item 1)

    python bench/fedlagc_ablation.py [--seeds 0 1 2] [--arms fiarse fedlagc ...]
                                     [--out runs/fedlagc_ablation] [--json FILE]

One setting, ``configs/fedlagc_digits.yaml`` (digits, Dir(0.5), 20 clients, 10 per round,
levels {1, 1/4, 1/16, 1/64} × {2, 4, 6, 8}, 2 local epochs, batch 20, lr 0.05, momentum 0.8,
30 rounds), and one factor changed per arm:

=================  ==========================================================================
arm                what changes (against FedLAGC's defaults)
=================  ==========================================================================
``fiarse``         FIARSE (the paper's strongest baseline), its code's rules
``fedlagc``        FedLAGC defaults (β = 0.1, h(t) = 1 for t < ⌊T/4⌋)
``nogc``           no gradient correction (Table 2 "w/o GC")
``gc_strong``      the correction in the paper's regime of strength: β = 1 and h(t) = 1 in
                   every round (below)
``gc_long``        β = 0.1 and h(t) = 1 in every round (the correction never switches off)
``gc_dual``        as ``gc_long`` with the other sign, g̃ = (g + h λ) ⊙ M: the sign of an
                   ADMM / FedDyn dual, which opposes the client's past drift (the paper's
                   Eq. g̃ adds it: λ accumulates β·Δ and Δ ≈ −lr·Σg, so −λ points along −g's
                   past descent)
``global_masks``   FedLAGC's training (static masks, STE, correction) on FIARSE's allocation:
                   one magnitude threshold across all prunable layers (critical set kept)
``equal``          layer importance ``equal`` (Fig. 3(a)): the same keep ratio in every layer
=================  ==========================================================================

Why ``gc_strong``: the correction's size relative to the gradient is ‖h λ‖/‖g‖, and λ grows
by β·Δ per participation, Δ ≈ lr·τ/(1 − ρ)·g. The paper (lr 0.01, 5 epochs of batch 20 on
~500 samples: τ ≈ 125, ρ = 0.8, T = 1000 rounds, 10 % sampling, h on for 250 rounds ≈ 25
participations) has β·lr·τ/(1 − ρ) ≈ 0.6 per participation; here (lr 0.05, 2 epochs on ~70
samples: τ ≈ 7, 50 % sampling, h on for 7 rounds ≈ 3 participations, the first with λ = 0)
it is ≈ 0.09. The arm measures that ratio (``lambda_over_grad``: mean over the steps where
h λ ≠ 0, from a probe that only reads the gradient) instead of trusting the estimate: it
measured 0.24–0.71 at the defaults, because the paper's sign feeds λ back into itself. With
c = lr·τ/(1 − ρ), a participation moves Δ ≈ −c·(ḡ − h λ), so λ ← λ + βΔ = (1 + βc)·λ − βc·ḡ:
λ grows geometrically while h = 1, by 1 + βc per participation (FedLAGC's switch-off at
⌊T/4⌋ is what bounds it; ``gc_strong`` at β = 1 diverged, ‖hλ‖/‖g‖ ≈ 1e13).

Every (arm, seed) is one in-process run through :func:`paper_direction.one_run` (its cache,
its ``runtime.threads=1`` on CPU); the wall time of each run is recorded (the machine is
shared: times are noise beyond their order). Per run: the test accuracy (mean over levels)
per round, the per-level accuracy of the last 5 rounds, the round-30 keep ratio of every
layer at every level, and the probe. Per arm: last-5 mean ± std, Δ paired by seed against
FIARSE and against FedLAGC; per round the gap FedLAGC − FIARSE (is it closing with rounds?).
Prints a markdown table and writes everything as JSON (``--json``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_direction as pd  # noqa: E402  (the direction suite's runner and cache)

from fedmpi.component import ClientTask  # noqa: E402
from fedmpi.methods.fedlagc import FedLAGC  # noqa: E402
from fedmpi.training.loop import StepHooks  # noqa: E402

HERE = "fedlagc_ablation"
#: ‖h λ‖ / ‖g‖ of every corrected step of the running process (probe arms only)
PROBE: list[float] = []


class ProbedFedLAGC(FedLAGC):
    """FedLAGC, unchanged, with a probe of ‖h λ ⊙ M‖ / ‖g ⊙ M‖ on every corrected step
    (reads the gradient before the method's own hook; the update is bit for bit FedLAGC's)."""

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        hooks = super().hooks(task, state, extras)
        lam, h = self.correction(task)
        inner = hooks.grad_hook
        if lam is None or not h or inner is None:
            return hooks
        mask = self._sub.mask[: self.P]

        def probed(f) -> None:
            g = f.grad * mask
            if self.ste:
                from fedmpi.methods.extraction import ste_factor
                g = g * ste_factor(f.params, self._sub.threshold)
            gn = float(torch.linalg.vector_norm(g))
            if gn > 0:
                PROBE.append(abs(h) * float(torch.linalg.vector_norm(lam * mask)) / gn)
            inner(f)
        return replace(hooks, grad_hook=probed)


class DualSignFedLAGC(ProbedFedLAGC):
    """g̃ = (g + h(t) λ) ⊙ M: the correction with an ADMM/FedDyn dual's sign (``gc_dual``)."""

    def correction(self, task: ClientTask) -> tuple[Optional[torch.Tensor], float]:
        lam, h = super().correction(task)
        return lam, -h


class GlobalMaskFedLAGC(ProbedFedLAGC):
    """FedLAGC's training on FIARSE's allocation: one magnitude threshold over all prunable
    entries, FedLAGC's critical set kept, static masks (``global_masks``)."""

    rule = "global"

    def extractor_options(self) -> dict:
        return {}


def algo(cls: type) -> str:
    return f"algorithm.name={HERE}:{cls.__name__}"


PROBED, LAGC = algo(ProbedFedLAGC), "algorithm.fedlagc."
STRONG = (LAGC + "beta=1.0", LAGC + "correction_fraction=1.0")
ARMS = {
    "fiarse": pd.Arm("fiarse", "FIARSE", ("algorithm.name=fiarse",)),
    "fedlagc": pd.Arm("fedlagc", "FedLAGC", (PROBED,)),
    "nogc": pd.Arm("nogc", "FedLAGC w/o GC", (PROBED, LAGC + "correction=false")),
    "gc_strong": pd.Arm("gc_strong", "GC β = 1, h = 1 every round", (PROBED, *STRONG)),
    "gc_long": pd.Arm("gc_long", "GC β = 0.1, h = 1 every round",
                      (PROBED, LAGC + "correction_fraction=1.0")),
    "gc_dual": pd.Arm("gc_dual", "GC dual sign (g + hλ), β = 0.1, every round",
                      (algo(DualSignFedLAGC), LAGC + "correction_fraction=1.0")),
    "global_masks": pd.Arm("global_masks", "FedLAGC on FIARSE's global-threshold masks",
                           (algo(GlobalMaskFedLAGC),)),
    "equal": pd.Arm("equal", "importance equal (same ratio per layer)",
                    (PROBED, LAGC + "importance=equal")),
}
COMP = pd.Comparison("fedlagc_ablation", "FedLAGC", "configs/fedlagc_digits.yaml, 30 rounds",
                     pd.cfg("fedlagc_digits.yaml"), (), ARMS["fiarse"], ())


def run(arm: pd.Arm, seed: int, out: Path, run_missing: bool = True) -> Optional[dict]:
    """One (arm, seed): from the cache or a fresh run (None if not cached and not
    ``run_missing``); its curves, level accuracies, keep ratios, probe and wall time (the
    probe and time stored beside the cache entry)."""
    from fedmpi.log.reader import read

    key = pd.run_key(COMP.config, pd.run_sets(COMP, arm, seed, False))
    side = out / "probe" / f"{key}.json"
    PROBE.clear()
    t0 = time.perf_counter()
    acc = pd.one_run(COMP, arm, seed, out, False, run_missing)
    if acc is None:
        if not run_missing:
            return None
        raise SystemExit(f"{arm.key} seed {seed} failed")
    if not side.exists():
        side.parent.mkdir(parents=True, exist_ok=True)
        side.write_text(json.dumps({"wall_s": round(time.perf_counter() - t0, 1),
                                    "lambda_over_grad": float(np.mean(PROBE)) if PROBE else None,
                                    "corrected_steps": len(PROBE)}))
    probe = json.loads(side.read_text())
    log = read(out / "logs" / key / "log.h5")
    levels = np.asarray(log.arrays["submodel/level_accuracy"], dtype=float)
    return {"seed": seed, "test_accuracy": acc.tolist(), "last5": pd.last_mean(acc),
            "rounds_to": {f"{t:g}": first_reach(acc, t) for t in TARGETS},
            "early": float(acc[EARLY].mean()),
            "level_last5": levels[-pd.LAST:].mean(0).tolist(),
            "keep_ratio_last": np.asarray(log.arrays["submodel/keep_ratio"])[-1].tolist(),
            **probe}


#: accuracies (mean over levels) whose first round is reported: the paper's communication
#: claim is rounds to a target accuracy
TARGETS = (0.80, 0.85, 0.88)


#: rounds 6-10 (0-based slice): the early window, where the curves cross later
EARLY = slice(5, 10)


def first_reach(acc: np.ndarray, target: float) -> Optional[int]:
    """First round (1-based) with test accuracy ≥ ``target``; None if never."""
    hit = np.flatnonzero(acc >= target)
    return int(hit[0]) + 1 if hit.size else None


def paired(a: list[dict], b: list[dict], what: str = "last5") -> dict:
    """``what`` (last-5 or the early window) of ``a`` minus ``b``'s, paired by seed."""
    by = {r["seed"]: r[what] for r in b}
    d = np.array([100 * (r[what] - by[r["seed"]]) for r in a if r["seed"] in by])
    return {"mean": float(d.mean()), "std": pd.std(d), "better": int((d > 0).sum()),
            "seeds": int(d.size), "per_seed": [round(float(x), 2) for x in d]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", default=str(pd.ROOT / "runs" / "fedlagc_ablation"))
    ap.add_argument("--json", default=None, help="write the result here too")
    ap.add_argument("--summary-only", action="store_true", help="cached runs only")
    args = ap.parse_args()
    sys.modules.setdefault(HERE, sys.modules[__name__])   # algorithm.name finds these classes
    out = Path(args.out)
    res: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for key in args.arms:
            one = run(ARMS[key], seed, out, not args.summary_only)
            if one is not None:
                res.setdefault(key, []).append(one)
    arms = {}
    for key, runs in res.items():
        last = 100 * np.array([r["last5"] for r in runs])
        probe = [r["lambda_over_grad"] for r in runs if r["lambda_over_grad"] is not None]
        arms[key] = {"label": ARMS[key].label, "sets": list(ARMS[key].sets),
                     "last5_mean": float(last.mean()), "last5_std": pd.std(last),
                     "level_last5_mean": (100 * np.mean([r["level_last5"] for r in runs], 0)).tolist(),
                     "lambda_over_grad": float(np.mean(probe)) if probe else None,
                     "wall_s": [r["wall_s"] for r in runs],
                     "rounds_to": {f"{t:g}": [r["rounds_to"][f"{t:g}"] for r in runs]
                                   for t in TARGETS},
                     "vs_fiarse": paired(runs, res["fiarse"]) if "fiarse" in res else None,
                     "vs_fedlagc": paired(runs, res["fedlagc"]) if "fedlagc" in res else None,
                     "early_vs_fiarse": (paired(runs, res["fiarse"], "early")
                                         if "fiarse" in res else None),
                     "runs": runs}
    gap = None
    if "fiarse" in res and "fedlagc" in res:
        by = {r["seed"]: r["test_accuracy"] for r in res["fiarse"]}
        d = np.array([np.subtract(r["test_accuracy"], by[r["seed"]])
                      for r in res["fedlagc"] if r["seed"] in by])
        gap = (100 * d.mean(0)).round(2).tolist() if d.size else None   # paired by seed
    result = {"setting": COMP.setting, "seeds": args.seeds, "arms": arms,
              "gap_fedlagc_minus_fiarse_per_round": gap}
    print("| arm | last-5 (mean of levels) | per level 1 / 1/4 / 1/16 / 1/64 | Δ vs FIARSE (better) "
          "| Δ vs FedLAGC (better) | Δ rounds 6–10 vs FIARSE | ‖hλ‖/‖g‖ "
          "| rounds to 80 / 85 / 88 % | wall s/run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, a in arms.items():
        def cell(p: Optional[dict]) -> str:
            return "–" if p is None else f"{p['mean']:+.2f} ± {p['std']:.2f} ({p['better']}/{p['seeds']})"
        probe = "–" if a["lambda_over_grad"] is None else f"{a['lambda_over_grad']:.3f}"
        print(f"| {a['label']} | {a['last5_mean']:.2f} ± {a['last5_std']:.2f} | "
              + " / ".join(f"{v:.1f}" for v in a["level_last5_mean"])
              + f" | {cell(a['vs_fiarse'])} | {cell(a['vs_fedlagc'])} | "
              f"{cell(a['early_vs_fiarse'])} | {probe} | "
              + " / ".join(",".join("–" if v is None else str(v) for v in a["rounds_to"][f"{t:g}"])
                           for t in TARGETS)
              + f" | {np.mean(a['wall_s']):.0f} |")
    text = json.dumps(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
