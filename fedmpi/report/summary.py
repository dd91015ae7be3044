"""``summary.md`` of ``fedmpi report``: the config digest and the keys that matter for the
run's method, what ran (``run_info``), results, time per round, clients and exclusions,
the server rule's per-client columns, a deadline or buffered run's arrivals and staleness,
and the events, as Markdown tables.

Rounds: "round t" is always the log's ``/rounds/round`` index, counted from 0
(as in ``fedmpi compare``, the events and the plots' x axes); counts of rounds
("rounds to target", the progress bar) are numbers of completed rounds, so a
target first met in round t took t + 1 rounds.

Just over 400 lines with one job: the sections of ``summary.md``, one function each.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedmpi.compare.runs import config_value, run_config, run_metrics
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

from fedmpi.report.arrivals import arrival_lines
from fedmpi.report.cross_site import cross_site_lines
from fedmpi.report.site_models import site_model_lines
from fedmpi.report.derived import (METRIC_LABELS, OVERHEAD_PARTS, OVERLAPPED, TIME_PARTS,
    byte_unit, level_labels, metric_names, metric_text, site_labels, time_parts, time_split)

__all__ = ["DIGEST_KEYS", "RULE_COLUMNS", "relevant_keys", "set_keys", "summary_markdown"]

_MAX_EVENTS = 50


#: Config keys listed in the summary of every run (when present in the log's config).
DIGEST_KEYS: tuple[str, ...] = (
    "seed", "data.dataset", "data.num_clients", "data.partition.method", "data.partition.alpha",
    "data.partition.classes_per_client", "data.silos.path", "data.silos.loader", "data.silos.test",
    "data.silos.validation", "data.validation.fraction", "model.name", "model.mlp.hidden",
    "model.norm",
    "algorithm.name", "aggregation.weighting", "ecgr.enabled", "train.rounds",
    "train.clients_per_round", "train.local_epochs", "train.local_steps", "train.batch_size",
    "train.lr", "train.momentum", "train.weight_decay", "train.grad_clip", "eval.every")

#: the silo files' keys, shown without their machine directories
#: (:func:`fedmpi.data.silos.shown_path`)
_SILO_PATHS = ("data.silos.path", "data.silos.test", "data.silos.validation",
               "data.silos.client_test")


def relevant_keys(flat: dict[str, Any]) -> list[str]:
    """The config keys that matter for this run, in summary order: :data:`DIGEST_KEYS`,
    ``algorithm.server_lr``, the parameter blocks the method declares
    (``Algorithm.params``: ``algorithm.<group>.*``, e.g. ``algorithm.fedprox.*``) or that
    carry its name, the resource levels (``system.*``, with ``algorithm.submodel.*``);
    then FedVG's keys with FedVG weighting, ECGR's when
    enabled, the lr schedule when it decays, the adversary when there is one. Unset
    (None) values and partition parameters of other partition methods are left out."""
    from fedmpi.methods import ALGORITHMS

    def under(*prefixes: str) -> list[str]:
        return [k for k in flat if any(k == p or (p.endswith(".") and k.startswith(p))
                                       for p in prefixes)]

    algo = str(flat.get("algorithm.name", ""))
    cls = ALGORITHMS.get(algo)
    # declared blocks, and the block named after the method (keys not yet declared as params)
    groups = tuple(f"algorithm.{g}."
                   for g in dict.fromkeys([*(cls.params if cls is not None else ()), algo,
                                           "params"]))
    if flat.get("system.levels"):      # a resource-level (submodel) run
        groups += ("algorithm.submodel.",)
    method = flat.get("data.partition.method")
    skip = {"data.partition.alpha": method not in (None, "dirichlet"),
            "data.partition.classes_per_client": method not in (None, "shards")}
    keys = [k for k in DIGEST_KEYS if k in flat]
    keys += [*under("algorithm.server_lr", *groups), *under("system.")]
    if flat.get("aggregation.weighting") in ("fedvg", "fedvg_avg"):
        keys += under("aggregation.fedvg.", "data.validation.")
    if flat.get("ecgr.enabled"):
        keys += under("ecgr.")
    if flat.get("train.lr_decay_every"):
        keys += under("train.lr_decay", "train.lr_decay_every")
    if flat.get("adversary.clients"):
        keys += under("adversary.")
    rule = str(flat.get("aggregation.rule", "mean"))
    if rule != "mean":
        keys += under("aggregation.rule", f"aggregation.{rule}.", "aggregation.params.")
    if flat.get("privacy.dp.level", "none") != "none":
        keys += under("privacy.")
    out: list[str] = []
    for k in keys:
        if k not in out and flat.get(k) is not None and not skip.get(k, False):
            out.append(k)
    return out


def set_keys(flat: dict[str, Any]) -> list[str]:
    """The keys of the flat config whose value is not the schema default: every key the
    run's config (file, ``--set``, API) set to something else, in config order. Keys the
    schema does not know (a user method's ``algorithm.params.*``, the flat keys of an
    older release) are :func:`relevant_keys`' business."""
    from fedmpi.config.schema import SCHEMA

    def default(key: str) -> Any:
        d = SCHEMA[key].default
        return list(d) if isinstance(d, tuple) else d

    def plain(v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    return [k for k, v in flat.items() if k in SCHEMA and plain(v) != default(k)]


def summary_markdown(log: RunLog | PathLike, target: float | None = None,
                     plots: Sequence[str] = (), plots_note: str | None = None) -> str:
    """``summary.md``: config digest, accuracies, rounds to target, timing, exclusions, events.
    ``plots_note``: why no plots were drawn (shown under "Plots")."""
    log = as_run_log(log)
    m = run_metrics(log, target)
    flat = run_config(log)   # only keys the run used: no data.dataset for a silo run
    digest = hashlib.sha256(str(log.attrs.get("config_yaml", "")).encode()).hexdigest()[:12]
    name = flat.get("name", Path(log.path).parent.name)
    out = [f"# Run report: {name}", "",
           f"- log: `{log.path}`",
           f"- status: **{log.status}**{f' ({m.note})' if m.note else ''}, {m.rounds_logged} of "
           f"{m.rounds_configured if m.rounds_configured is not None else '?'} rounds logged",
           f"- fedmpi {log.attrs.get('fedmpi_version', '?')}, world size "
           f"{log.attrs.get('world_size', '?')}"
           + (f" (resumed with world sizes {log.attrs['resumed_world_sizes']})"
              if "resumed_world_sizes" in log.attrs else ""),
           "- rounds are numbered from 0 as in the log (`/rounds/round`); \"N rounds\" "
           "counts completed rounds",
           "", "## Configuration", "",
           f"Config digest `sha256:{digest}` (of the resolved YAML stored in the log); the keys "
           "that matter for this run's method and every key set away from its default (all: "
           "`config.yaml`, or `config_yaml` in the log).",
           "", "| key | value |", "|---|---|"]
    shown = relevant_keys(flat)
    shown += [k for k in set_keys(flat) if k not in shown]
    from fedmpi.data.silos import shown_path

    for key in shown:
        value = flat[key]
        if key in _SILO_PATHS and isinstance(value, str):   # no machine path in a report
            value = shown_path(value)
        out.append(f"| {key} | {_cell(value)} |")
    out += _ran_lines(log)

    out += ["", "## Results", "",
            "Metrics as the log holds them: fractions (accuracy 0.9667 is 96.67 %), four "
            "decimals.", "", "| metric | value |", "|---|---|"]
    out.append(f"| final test accuracy | {metric_text(m.final_accuracy)}"
               + (f" (round {m.final_round})" if m.final_round is not None else "") + " |")
    out.append(f"| best test accuracy | {metric_text(m.best_accuracy)}"
               + (f" (round {m.best_round})" if m.best_round is not None else "") + " |")
    for name, value in m.final_metrics.items():   # further eval.metrics of the log
        out.append(f"| final {name} | {metric_text(value)} |")
    if target is not None:
        tau = m.rounds_to_target
        out.append(f"| rounds to test accuracy {metric_text(target)} | "
                   + (f"{int(tau)} (first reached in round {int(tau) - 1})" if math.isfinite(tau)
                      else "not reached") + " |")
    if m.epsilon is not None:
        stop = log.attrs.get("stop_reason")
        out.append(f"| privacy: ε at δ={flat.get('privacy.dp.delta')} "
                   f"({flat.get('privacy.dp.level')} level) | {m.epsilon:.4g} after round "
                   f"{int(log.rounds['round'][-1])}" + (f"; {stop}" if stop else "") + " |")
    loss = log.rounds.get("test_loss")
    if loss is not None and np.isfinite(loss).any():
        out.append(f"| final test loss | {metric_text(loss[np.isfinite(loss)][-1])} |")
    la = log.arrays.get("submodel/level_accuracy")
    if la is not None and la.ndim == 2 and np.isfinite(la).any():
        last = [np.flatnonzero(np.isfinite(la[:, v])) for v in range(la.shape[1])]
        cells = [f"{name}: {metric_text(la[idx[-1], v])}" if idx.size else f"{name}: —"
                 for v, (name, idx) in enumerate(zip(level_labels(log, la.shape[1]), last))]
        out.append(f"| final accuracy per submodel level | {'; '.join(cells)} |")
    out += _time_lines(log)
    for key, label in (("bytes_up", "uplink bytes sent"), ("bytes_down", "downlink bytes sent"),
                       ("bytes_up_encoded", "uplink bytes encoded"),
                       ("bytes_down_encoded", "downlink bytes encoded")):
        if key in log.rounds and len(log.rounds[key]):
            total = float(np.sum(log.rounds[key]))
            unit, scale = byte_unit(total)
            out.append(f"| {label} (total) | {total / scale:.3g} {unit} |")

    out += ["", "## Sites", ""]
    out += _client_lines(log)
    out += _rule_lines(log)
    out += cross_site_lines(log)
    out += site_model_lines(log)
    out += arrival_lines(log)
    out += ["", "## Events", ""]
    out += _event_lines(log)
    if plots or plots_note:
        out += ["", "## Plots", ""]
        out += [f"![{p}]({p})" for p in plots]
        out += [f"Not drawn: {plots_note}."] if plots_note else []
    if m.rounds_logged == 0:
        out.insert(5, "- **no complete round in the log** (the run stopped or is still in its "
                      "first round)")
    return "\n".join(out) + "\n"


def _params_text(blocks: Any) -> str:
    """``{block: {field: value}}`` as ``block: field=value, ...; block: ...``."""
    if not isinstance(blocks, dict):
        return ""
    return "; ".join(f"{g}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
                     for g, fields in blocks.items() if isinstance(fields, dict))


def _ran_lines(log: RunLog) -> list[str]:
    """"What ran": the log's ``run_info`` (:mod:`fedmpi.job.provenance`) — the objects by
    built-in name or import path, the method's parameters, the silo files with SHA-256."""
    from fedmpi.job.provenance import read_run_info

    info = read_run_info(log.attrs)
    if info is None:
        return []
    out = ["", "## What ran", "", "| part | as run |", "|---|---|"]
    model = info.get("model", {})
    out.append("| model | `{}`{} |".format(model.get("name"), "".join(
        f", {k} {v}" for k, v in model.items() if k != "name")))
    data = info.get("data", {})
    source = (f"silos `{data['silos'].get('path') or data['silos'].get('loader')}`"
              if isinstance(data.get("silos"), dict) else f"`{data.get('dataset')}`")
    out.append(f"| data | {source}, {data.get('num_clients')} clients, partition "
               f"{data.get('partition')} |")
    method = info.get("method", {})
    params = _params_text(method.get("params"))
    out.append(f"| method | `{method.get('name')}` (server_lr {method.get('server_lr')}"
               f"{'; ' + params if params else ''}) |")
    wparams = _params_text(info.get("weighting_params"))
    out.append(f"| weighting | `{info.get('weighting')}`{f' ({wparams})' if wparams else ''} |")
    rule = info.get("rule") or {}
    if rule:
        rparams = _params_text(rule.get("params"))
        out.append(f"| server rule | `{rule.get('name')}`{f' ({rparams})' if rparams else ''} |")
    tparams = info.get("transform_params") or {}
    shown = []
    for t in info.get("transforms", []):
        text = _params_text(tparams.get(t) if isinstance(tparams, dict) else None)
        shown.append(f"`{t}`{f' ({text})' if text else ''}")
    out.append(f"| transforms | {', '.join(shown) or 'none'} |")
    files = data.get("silos", {}).get("files", []) if isinstance(data.get("silos"), dict) else []
    if files:
        out += ["", "| silo file | path | SHA-256 |", "|---|---|---|"]
        names = site_labels(log)
        roles = {f"client {k}": f"{n} (client {k})" if n != f"client {k}" else n
                 for k, n in enumerate(names)}
        out += [f"| {roles.get(str(f.get('role')), _cell(f.get('role')))} | "
                f"`{_cell(f.get('path'))}` | `{_cell(f.get('sha256'))}` |" for f in files]
    return out


def _time_lines(log: RunLog) -> list[str]:
    """Mean time per round and its split (:func:`time_split`); the in-round parts are
    shares of the wall time and add up to 100 %."""
    split = time_split(log) if len(log.rounds.get("round", ())) else {}
    wall = split.get("wall_seconds")
    if wall is None:
        return []
    mean_wall = float(wall.mean())
    lines = [f"| mean time per round | {mean_wall:.3f} s (total {wall.sum():.1f} s) |"]
    for key, label, _ in TIME_PARTS:
        if key in split:
            v = float(split[key].mean())
            share = f"{100 * v / mean_wall:.1f}%" if mean_wall > 0 else "—"
            label += " (in the round)" if key == "eval_seconds" else ""
            lines.append(f"| &nbsp;&nbsp;{label} | {v:.3f} s ({share}) |")
            if key == "overhead_seconds":   # its measured parts, where the log splits it
                lines += _overhead_lines(split, mean_wall)
    over = split.get("eval_overlapped")
    if over is not None and over.any():
        lines.append(f"| {OVERLAPPED} | {over.mean():.3f} s per round |")
    return lines


def _overhead_lines(split: dict[str, np.ndarray], mean_wall: float) -> list[str]:
    """One row per measured part of the overhead that is not 0 throughout (sub-rows: their
    shares are of the wall time, and are part of the overhead's share)."""
    split_parts = {p for p, _, _ in OVERHEAD_PARTS}
    out = []
    for part, what, _ in time_parts(split, nonzero=True):
        if part in split_parts:
            v = float(split[part].mean())
            share = f", {100 * v / mean_wall:.1f}%" if mean_wall > 0 else ""
            out.append(f"| &nbsp;&nbsp;&nbsp;&nbsp;of which {what} | {v:.4f} s{share} |")
    return out


def _cell(value: Any) -> str:
    """A value as one Markdown table cell (``|`` escaped, on one line)."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _last(a: np.ndarray) -> float:
    """The last finite value of a per-round column (NaN if none)."""
    good = np.flatnonzero(np.isfinite(a))
    return float(a[good[-1]]) if good.size else math.nan


def _client_lines(log: RunLog) -> list[str]:
    """Sizes and selections in two lines, the per-site table (:func:`_site_table`), the
    excluded updates by site."""
    lines = []
    names = site_labels(log)
    sel = log.clients.get("selected")
    exc = log.clients.get("excluded")
    n = log.clients["num_samples"]
    lines.append(f"{len(n)} clients, {int(n.sum())} training samples "
                 f"(min {int(n.min()) if len(n) else 0}, max {int(n.max()) if len(n) else 0}).")
    if sel is not None and sel.size:
        never = np.flatnonzero(~sel.any(axis=0))
        counts = sel.sum(axis=0)
        lines.append(f"Selected {counts.min()}–{counts.max()} times per client"
                     + (f"; never selected: {', '.join(names[k] for k in never)}."
                        if never.size else "."))
    lines += ["", *_site_table(log, names)]
    if exc is not None and exc.any():
        lines += ["", "Excluded updates (non-finite or rejected):", "",
                  "| site | times excluded | rounds |", "|---|---|---|"]
        r = log.rounds["round"]
        for k in np.flatnonzero(exc.any(axis=0)):
            rounds = r[exc[:, k]].tolist()
            shown = ", ".join(map(str, rounds[:20])) + (" …" if len(rounds) > 20 else "")
            lines.append(f"| {names[k]} | {len(rounds)} | {shown} |")
    else:
        lines.append("")
        lines.append("No client update was excluded.")
    return lines


def _site_table(log: RunLog, names: list[str]) -> list[str]:
    """One row per site: its name and client index, training samples n_k, class counts
    (up to 10 classes), times selected and excluded, mean aggregation weight when
    selected, and with per-site evaluation (``eval.where``) its held-out samples and its
    last evaluated value of every metric."""
    k = log.num_clients
    cols: list[tuple[str, list[str]]] = [
        ("training samples", [str(int(v)) for v in log.clients["num_samples"]])]
    cc = log.arrays.get("partition/class_counts")
    if cc is not None and cc.ndim == 2 and cc.shape[0] == k and 1 < cc.shape[1] <= 10:
        cols.append(("per class", [" / ".join(str(int(v)) for v in row) for row in cc]))
    for key, label in (("selected", "selected"), ("excluded", "excluded")):
        a = log.clients.get(key)
        if a is not None and a.ndim == 2 and a.shape[1] == k and a.shape[0]:
            cols.append((label, [str(int(v)) for v in a.sum(0)]))
    w = log.clients.get("weight")
    if w is not None and w.ndim == 2 and w.shape[1] == k and np.isfinite(w).any():
        seen = np.isfinite(w)
        mean = np.where(seen.any(0), np.nansum(w, 0) / np.maximum(seen.sum(0), 1), np.nan)
        cols.append(("mean weight", [f"{v:.4f}" if math.isfinite(v) else "—" for v in mean]))
    per_round = {name: a for name, a in log.clients.items()
                 if a.ndim == 2 and a.shape == (log.num_rounds, k)}
    if "test_samples" in per_round:
        cols.append(("held-out samples", [f"{_last(per_round['test_samples'][:, j]):.0f}"
                                          for j in range(k)]))
    for name in [*metric_names(log), "test_loss"]:
        if name in per_round:
            cols.append((METRIC_LABELS.get(name, name),
                         [metric_text(_last(per_round[name][:, j])) for j in range(k)]))
    head = ["site", "client", *(c for c, _ in cols)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join([_cell(names[j]), str(j), *(v[j] for _, v in cols)]) + " |"
            for j in range(k)]
    if any(name in per_round for name in metric_names(log)):
        out += ["", "Per-site metrics: each site's last evaluated value, on its own held-out "
                    "samples (`/clients/<metric>`)."]
    return out


#: Per-client columns a server rule logs (fedmpi.aggregation.robust): what the value is, and
#: the name of a value of 0 when that means the client's update was left out.
RULE_COLUMNS: dict[str, tuple[str, str | None]] = {
    "rule/selected": ("selected (share of rounds)", "dropped"),
    "rule/trust": ("mean FLTrust trust score", "zero trust"),
    "rule/clip": ("mean clip factor", None),
    "rule/trimmed": ("mean share of coordinates trimmed", None),
    "rule/weight": ("mean geometric-median coefficient", None),
}


def _rule_lines(log: RunLog) -> list[str]:
    """``## Server rule``: per client the mean of the rule's column, and per round the
    clients a selecting rule left out (Krum's dropped clients, FLTrust's zero trust)."""
    lines: list[str] = []
    r = log.rounds.get("round", np.arange(0))
    for path, (label, zero) in RULE_COLUMNS.items():
        a = log.arrays.get(path)
        if a is None or a.ndim != 2 or not np.isfinite(a).any():
            continue
        if not lines:
            rule = config_value(log.config, "aggregation.rule", "mean")
            lines += ["", f"## Server rule ({rule})", ""]
        seen = np.isfinite(a)
        mean = np.where(seen.any(0), np.nansum(a, 0) / np.maximum(seen.sum(0), 1), np.nan)
        names = site_labels(log) if a.shape[1] == log.num_clients else \
            [f"client {k}" for k in range(a.shape[1])]
        lines += [f"| site | rounds seen | {label} |", "|---|---|---|"]
        lines += [f"| {names[k]} | {int(seen[:, k].sum())} | {mean[k]:.3g} |"
                  for k in range(a.shape[1]) if seen[:, k].any()]
        if zero is None:
            continue
        left_out = [(int(r[i]) if i < len(r) else i, np.flatnonzero(seen[i] & (a[i] == 0)))
                    for i in range(a.shape[0])]
        left_out = [(t, ks) for t, ks in left_out if ks.size]
        lines += ["", f"Clients {zero} per round:", "", f"| round | {zero} |", "|---|---|"]
        lines += [f"| {t} | {', '.join(names[k] for k in ks.tolist())} |"
                  for t, ks in left_out[:_MAX_EVENTS]]
        if not left_out:
            lines.append("| — | none |")
        elif len(left_out) > _MAX_EVENTS:
            lines.append(f"\n… {len(left_out) - _MAX_EVENTS} more rounds (`{path}` in the log).")
    return lines


def _event_lines(log: RunLog) -> list[str]:
    ev = log.events
    n = len(ev.get("round", []))
    if n == 0:
        return ["No events."]
    names = site_labels(log)
    lines = ["| round | rank | site | message |", "|---|---|---|---|"]
    for i in range(min(n, _MAX_EVENTS)):
        client = int(ev["client"][i])
        site = names[client] if 0 <= client < len(names) else \
            (str(client) if client >= 0 else "—")
        lines.append(f"| {int(ev['round'][i])} | {int(ev['rank'][i])} | "
                     f"{site} | {_cell(ev['message'][i])} |")
    if n > _MAX_EVENTS:
        lines.append(f"\n… {n - _MAX_EVENTS} more events (`fedmpi.log.read(path).events`).")
    return lines
