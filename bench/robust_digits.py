"""Attack table for the robust aggregation rules on digits (issue 24).

    python bench/robust_digits.py [--rounds 20] [--seeds 0 1 2]
        [--out bench/measured/cpu2-2026-11-24/robust_digits.json]

``configs/quickstart.yaml`` (digits, 10 silos, Dirichlet α = 0.5) with every
client in every round and the small ``mlp`` model, run in this process through
the Python API (:func:`fedmpi.run`, one rank, ``runtime.threads=1``). Grid:
attackers f ∈ {0, 1, 3} (clients 0…f−1) × attacks {scale ×10, sign_flip ×4,
label_flip, gaussian, alie} × rules {mean, fedvg (weighting, mean rule), median,
trimmed_mean, multi_krum, geometric_median, norm_clip, fltrust} × seeds; f = 0
runs once per rule (no attack). The defenders are configured for the worst
case of the table and never told the actual f: Krum/Multi-Krum f = 3,
trimmed mean β = 0.3 (3 of 10 per side), norm clipping at the median norm.

The JSON (rewritten after every cell, so a cut-short run keeps what it
measured) holds the final test accuracy of every run and, per cell, mean and
std (ddof 0) over the seeds; the markdown table goes to stdout at the end.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import fedmpi

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = {"scale": ["adversary.kind=scale", "adversary.factor=10"],
           "sign_flip": ["adversary.kind=sign_flip", "adversary.factor=4"],
           "label_flip": ["adversary.kind=label_flip"],
           "gaussian": ["adversary.kind=gaussian"],
           "alie": ["adversary.kind=alie"]}
RULES = {"mean": ["aggregation.rule=mean"],
         "fedvg": ["aggregation.rule=mean", "aggregation.weighting=fedvg"],
         "median": ["aggregation.rule=median"],
         "trimmed_mean": ["aggregation.rule=trimmed_mean", "aggregation.trimmed_mean.beta=0.3"],
         "multi_krum": ["aggregation.rule=multi_krum", "aggregation.multi_krum.f=3"],
         "geometric_median": ["aggregation.rule=geometric_median"],
         "norm_clip": ["aggregation.rule=norm_clip"],
         "fltrust": ["aggregation.rule=fltrust"]}


def cells(fs: list[int], attacks: list[str]) -> list[tuple[int, str]]:
    return [(f, a) for f in fs for a in (["none"] if f == 0 else attacks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--fs", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS))
    ap.add_argument("--rules", nargs="+", default=list(RULES))
    ap.add_argument("--runs", default="/tmp/fedmpi_robust_digits", help="run directories")
    ap.add_argument("--out", default=str(ROOT / "bench/measured/cpu2-2026-11-24/robust_digits.json"))
    args = ap.parse_args()
    base = [f"train.rounds={args.rounds}", "train.clients_per_round=null", "model.name=mlp",
            f"eval.every={args.rounds}", "runtime.threads=1", "runtime.progress=false"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = {"config": "configs/quickstart.yaml", "overrides": base, "seeds": args.seeds,
                 "attacks": {a: ATTACKS[a] for a in args.attacks},
                 "rules": {r: RULES[r] for r in args.rules}, "results": {}}
    t0 = time.perf_counter()
    for f, attack in cells(args.fs, args.attacks):
        adv = [] if f == 0 else [f"adversary.clients={list(range(f))}", *ATTACKS[attack]]
        for rule in args.rules:
            final, secs = [], []
            for seed in args.seeds:
                t = time.perf_counter()
                res = fedmpi.run("configs/quickstart.yaml",
                                 [*base, f"seed={seed}", *RULES[rule], *adv],
                                 out=f"{args.runs}/f{f}_{attack}_{rule}_s{seed}", overwrite=True)
                final.append(float(res.metrics["test_accuracy"]))
                secs.append(time.perf_counter() - t)
            doc["results"].setdefault(f"f={f}", {}).setdefault(attack, {})[rule] = {
                "final": final, "mean": float(np.mean(final)), "std": float(np.std(final)),
                "seconds_per_run": float(np.mean(secs))}
            doc["total_seconds"] = time.perf_counter() - t0
            out.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"f={f} {attack:10s} {rule:16s} {100 * np.mean(final):6.2f} ± "
                  f"{100 * np.std(final):5.2f}  ({np.mean(secs):.1f} s/run)", flush=True)
    print(table(doc))


def table(doc: dict) -> str:
    """Markdown: one row per (f, attack), one column per rule, accuracy % mean ± std."""
    rules = list(doc["rules"])
    lines = ["| f | attack | " + " | ".join(rules) + " |", "|---|---|" + "---|" * len(rules)]
    for f, by_attack in doc["results"].items():
        for attack, by_rule in by_attack.items():
            cells_ = [f"{100 * by_rule[r]['mean']:.1f} ± {100 * by_rule[r]['std']:.1f}"
                      if r in by_rule else "" for r in rules]
            lines.append(f"| {f[2:]} | {attack} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
