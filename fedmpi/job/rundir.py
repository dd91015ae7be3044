"""Who may write a run directory, and what a run directory may be resumed with (issue 18).

Conventions (docs/cluster.md, "Run directories"):

* **One writer.** :func:`prepare` (rank 0, before anything is written) takes the lock
  ``<out>/.fedmpi.lock``; a second run stops with exit 2 naming the holder, a stale lock
  is taken over. The lock itself (link + flock, heartbeat, stale rules) is
  :mod:`fedmpi.job.lock`; its names are re-exported here.
* **No silent replacement.** A fresh run into a directory holding a previous run
  (``log.h5``, ``checkpoint.pt`` or ``model.pt``) stops with exit 2 unless
  ``--overwrite`` is given; then the previous run's files (those three, ``config.yaml``,
  leftover temporary checkpoint files, and the report and stats derived from it in
  ``report/`` and ``stats/``) are deleted first. A previous run that
  produced nothing — a readable fedmpi log with no round in it, no checkpoint, no
  ``best.pt`` (a ``model.pt`` beside it is the initial model): a run that failed or was stopped before its first round,
  however it ended (a traceback, an abort under MPI, a kill) — holds no result and is
  replaced without ``--overwrite``, with a note, so it never blocks the corrected rerun.
* **Resume only the same run.** The *fingerprint* is the SHA-256 of the canonical JSON of
  every config key except :data:`MAY_CHANGE_ON_RESUME` (run length, where data lives,
  evaluation and runtime settings) whose value differs from its default. It is stored in
  the checkpoint and as the log's root attribute ``fingerprint``. ``--resume`` compares
  the stored config key by key (:func:`check_same_run`): a differing run-defining key
  stops with exit 2 naming it; a key added by a later release counts as equal while it
  keeps its default (the older run's behaviour), so runs of older releases resume. ``--resume`` with a log but no checkpoint (a run killed
  before its first checkpoint) is refused (exit 2: start again with ``--overwrite``), so no
  log ever has missing rounds.
* **Output paths** of every command (``run``, ``report``, ``compare``, ``partition``) go
  through :func:`output_dir`: an ``--out`` under a file, on a read-only filesystem, in
  ``/proc`` or naming an existing file stops with exit 2 naming it.
"""
from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from fedmpi.errors import RunDirError
from fedmpi.job.lock import (LOCK_NAME, acquire, release, user_label)
from fedmpi.job.safefile import refuse_links
from fedmpi.config.core import Config

__all__ = ["MAY_CHANGE_ON_RESUME", "RUN_FILES", "WRITTEN", "RunDir", "check_same_run",
           "fingerprint", "may_change_on_resume", "output_dir", "prepare", "resume_history",
           "run_defining"]

#: Files whose presence means "a previous run lives here".
RUN_FILES = ("log.h5", "checkpoint.pt", "model.pt")
#: Also removed by ``--overwrite`` (glob patterns): the side files and the temporary
#: names of every file (:func:`fedmpi.job.safefile.temp_name`: ``.<name>.tmp-*``).
_SIDE_FILES = ("config.yaml", "best.pt", "local_models/*.pt", "local_models/.*.pt.tmp-*",
               *(f".{name}.tmp-*" for name in (*RUN_FILES, "config.yaml", "best.pt")))
#: Every name fedmpi writes in a run directory: none of them may be a symbolic link
#: (``local_models/``: eval.cross_site_models, :mod:`fedmpi.consortium.cross_site`).
WRITTEN = (LOCK_NAME, *RUN_FILES, *_SIDE_FILES, "report", "local_models", "stats")


#: Config keys (``fnmatch`` patterns) that may differ between a checkpoint and the run
#: resuming it: how long to run, where the data lives, how to evaluate, how to execute.
#: Everything else defines the run (seed, data, partition, model, method, weighting,
#: adversaries ...) and is in the fingerprint.
MAY_CHANGE_ON_RESUME = ("name", "train.rounds", "data.root", "data.download", "eval.*",
                        "runtime.*")

# ----------------------------------------------------------------- fingerprint
def may_change_on_resume(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE_ON_RESUME)


def run_defining(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The run-defining part of a flat ``{dotted key: value}`` config."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()
            if not may_change_on_resume(k)}


def _default(key: str) -> Any:
    """The schema default of ``key`` (a unique sentinel for keys outside the schema)."""
    from fedmpi.config.schema import SCHEMA

    field = SCHEMA.get(key)
    if field is None:
        return _NO_DEFAULT
    return list(field.default) if isinstance(field.default, tuple) else field.default


_NO_DEFAULT = object()


def fingerprint(cfg: Config) -> str:
    """SHA-256 (hex) of the canonical JSON of the run-defining config keys that differ
    from their schema default.

    Keys at their default are left out, so a release that adds a key (whose default
    keeps the older behaviour, the rule for every new key) leaves the fingerprint of
    every older run unchanged: such runs stay resumable (issue 31)."""
    keys = {k: v for k, v in run_defining(_flat(cfg.to_dict())).items() if v != _default(k)}
    text = json.dumps(keys, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _differences(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """Run-defining keys of ``new`` that define another run than ``old`` (a stored
    config): a different value, or a key the older release did not have (absent from
    ``old``) set away from its default. Keys only ``old`` has were removed since."""
    return [k for k in new
            if (old[k] != new[k] if k in old else new[k] != _default(k))]


def check_same_run(cfg: Config, stored_fingerprint: Optional[str], stored_yaml: Optional[str],
                   source: Path) -> None:
    """Raise :class:`RunDirError` naming the first run-defining key that differs from
    the run stored in ``source`` (a checkpoint or a log).

    Decided on the stored config (``stored_yaml``) key by key where there is one
    (:func:`_differences`: a run of an older release, whose fingerprint was computed
    over another set of keys, resumes; a default that changed since does not slip
    through), else on the fingerprint."""
    new = run_defining(_flat(cfg.to_dict()))
    old: Optional[dict[str, Any]] = None
    if stored_yaml:
        import yaml

        try:
            loaded = yaml.safe_load(stored_yaml)
            old = run_defining(_flat(loaded)) if isinstance(loaded, dict) else None
        except yaml.YAMLError:
            old = None
    if old is None:
        if stored_fingerprint is None or stored_fingerprint == fingerprint(cfg):
            return
        key = "an unknown key"
    else:
        diff = _differences(new, old)
        if not diff:
            return
        there = repr(old[diff[0]]) if diff[0] in old else "not set"
        key = f"{diff[0]!r} ({there} there, {new[diff[0]]!r} now)"
    raise RunDirError(f"{source}: belongs to another run: config key {key} differs; only "
                      f"{', '.join(MAY_CHANGE_ON_RESUME)} may change on --resume (start a new "
                      "run with another --out, or --overwrite)")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 0.1}}`` -> ``{"train.lr": 0.1}``."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resume_history(log_path: Path, ckpt_path: Path, rounds: int, cfg: Config) -> list[dict]:
    """Rounds < ``rounds`` of the log to resume, as ``Federation.history`` rows.

    The log must belong to the same run as the checkpoint (fingerprint) and hold
    every round the checkpoint covers; else :class:`RunDirError` (exit 2)."""
    from fedmpi.log.reader import read

    log = read(log_path)
    check_same_run(cfg, log.attrs.get("fingerprint"), log.attrs.get("config_yaml"), log_path)
    logged = [int(r) for r in log.rounds.get("round", []) if r < rounds]
    if logged != list(range(rounds)):
        raise RunDirError(f"{ckpt_path}: checkpoint of rounds 0..{rounds - 1}, but {log_path} "
                          f"holds {len(logged)} of them: checkpoint and log are not of one run "
                          "(start again with --overwrite)")
    keep = log.rounds["round"] < rounds
    names = [n for n in log.rounds if n != "round"]   # every scalar, as the live rows hold
    return [{"round": int(r), **{n: float(log.rounds[n][i]) for n in names}}
            for i, r in enumerate(log.rounds["round"]) if keep[i]]


# ------------------------------------------------------------------ out paths
def output_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """Create directory ``path`` (and parents) and check that files can be created in it.

    Raises :class:`RunDirError` naming the path for an existing non-directory, a parent
    that is a file, a read-only or pseudo filesystem (``/proc``), or no permission.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{what} {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".fedmpi-write-test-{os.getpid()}"
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.errno == errno.ENOTDIR:
            reason = "a parent is not a directory"
        raise RunDirError(f"{what} {out}: cannot write there ({reason})") from None
    return out


# -------------------------------------------------------------------- prepare
@dataclass
class RunDir:
    """An output directory that this process owns until :func:`release`."""

    path: Path
    fingerprint: str
    stale_lock: Optional[str] = None   # the dead holder whose lock was taken over


def prepare(out: str | os.PathLike, cfg: Config, resume: bool, overwrite: bool) -> RunDir:
    """Rank 0, before anything is written: lock ``out`` and apply the conventions of
    the module docstring. Raises :class:`RunDirError` (exit 2)."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: continue the run in "
                          f"{out}, or replace it")
    path = output_dir(out)
    refuse_links(path, WRITTEN, "a run directory")
    stale = acquire(path, cfg.runtime.round_timeout)
    try:
        present = [name for name in RUN_FILES if (path / name).exists()]
        _refuse_foreign(path, present + [n for n in ("config.yaml",) if (path / n).exists()])
        if resume and not (path / "checkpoint.pt").exists() and (path / "log.h5").exists():
            raise RunDirError(f"{path / 'checkpoint.pt'}: missing, but {path / 'log.h5'} holds a "
                              "run that stopped before its first checkpoint; nothing to resume: "
                              "start it again with --overwrite (no --resume)")
        if not resume and present:
            unstarted = _unstarted_run(path, present)
            if not overwrite and unstarted is None:
                raise RunDirError(f"{path}: holds a previous run ({', '.join(present)}); "
                                  "continue it with --resume, replace it with --overwrite, or "
                                  "use another --out")
            if not overwrite:
                print(f"fedmpi: note: {path}: replacing a previous run that {unstarted} and "
                      "logged no round (nothing to keep)", file=sys.stderr, flush=True)
            for pattern in RUN_FILES + _SIDE_FILES:
                for old in path.glob(pattern):
                    old.unlink()
            # the report and stats derived from the replaced run (issue 48)
            from fedmpi.job.outputs import remove_written
            for derived in ("report", "stats"):
                remove_written(path / derived)
    except BaseException:
        release()
        raise
    return RunDir(path, fingerprint(cfg), stale)


def _unstarted_run(path: Path, present: list[str]) -> Optional[str]:
    """How the previous run in ``path`` ended (``"failed"``, ``"was interrupted"``, ...)
    if it produced nothing (no round in a readable fedmpi log, no checkpoint, no model;
    module docstring), else None. Called under the lock, so its writer is gone."""
    # model.pt beside a log of no round is the initial model (written by releases before
    # 48 for a run stopped at start-up): no result either
    if present not in (["log.h5"], ["log.h5", "model.pt"]) or (path / "best.pt").exists():
        return None
    from fedmpi.errors import LogFormatError
    from fedmpi.log.reader import read

    try:
        log = read(path / "log.h5")
    except (LogFormatError, OSError):
        return None   # not readable as a fedmpi log: it may be anything; keep it
    if len(log.rounds.get("round", [])):
        return None
    return {"failed": "failed", "interrupted": "was interrupted", "completed": "completed",
            "running": "ended without a final status"}.get(log.status, f"ended {log.status}")


def _refuse_foreign(path: Path, names: list[str]) -> None:
    """Files of another user that this one could not replace (a sticky ``/tmp``-style
    directory, or a directory of theirs): say whose they are, in one line."""
    me = os.geteuid()
    if me == 0:
        return
    st_dir = os.stat(path)
    sticky = bool(st_dir.st_mode & 0o1000)
    foreign: dict[int, list[str]] = {}
    for name in names:
        st = os.stat(path / name, follow_symlinks=False)
        if st.st_uid != me and (sticky and st_dir.st_uid != me or not os.access(path, os.W_OK)
                                or not os.access(path / name, os.W_OK)):
            foreign.setdefault(st.st_uid, []).append(name)
    if foreign:
        uid, files = next(iter(foreign.items()))
        raise RunDirError(f"{path}: holds a run of user {user_label(uid)} ({', '.join(files)}), which "
                          f"you ({user_label(me)}) may not replace or continue here: use another "
                          f"--out, or ask {user_label(uid).split()[0]} to remove those files")
