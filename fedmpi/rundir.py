"""Who may write a run directory, and what a run directory may be resumed with (issue 18).

Conventions (docs/cluster.md, "Run directories"):

* **One writer.** :func:`prepare` (rank 0, before anything is written) creates the lock
  file ``<out>/.fedmpi.lock`` with ``O_CREAT | O_EXCL`` holding ``host pid start-time``.
  A second run finds it and stops with exit 2 naming the holder. A lock whose process
  is gone — same host and the pid is dead, or the pid now belongs to a process started
  at another time — is stale and taken over (an event in the log says so). A lock from
  another host cannot be checked and is respected; the message says which file to
  remove. The lock is removed when the run ends (any exit that runs Python's
  ``finally``; after ``MPI_Abort`` or ``SIGKILL`` it is stale).
* **No silent replacement.** A fresh run into a directory holding a previous run
  (``log.h5``, ``checkpoint.pt`` or ``model.pt``) stops with exit 2 unless
  ``--overwrite`` is given; then the previous run's files (those three, ``config.yaml``
  and leftover temporary checkpoint files) are deleted first.
* **Resume only the same run.** The *fingerprint* is the SHA-256 of the canonical JSON of
  every config key except :data:`MAY_CHANGE_ON_RESUME` (run length, where data lives,
  evaluation and runtime settings). It is stored in the checkpoint and as the log's root
  attribute ``fingerprint``; ``--resume`` with a different fingerprint stops with exit 2
  naming the first differing key. ``--resume`` with a log but no checkpoint (a run killed
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
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import UserError
from .log import pid_alive

LOCK_NAME = ".fedmpi.lock"
#: Files whose presence means "a previous run lives here".
RUN_FILES = ("log.h5", "checkpoint.pt", "model.pt")
#: Also removed by ``--overwrite`` (glob patterns).
_SIDE_FILES = ("config.yaml", ".checkpoint.pt.tmp-*", ".model.pt.tmp-*")

#: Config keys (``fnmatch`` patterns) that may differ between a checkpoint and the run
#: resuming it: how long to run, where the data lives, how to evaluate, how to execute.
#: Everything else defines the run (seed, data, partition, model, method, weighting,
#: adversaries ...) and is in the fingerprint.
MAY_CHANGE_ON_RESUME = ("name", "train.rounds", "data.root", "data.download", "eval.*",
                        "runtime.*")

_held: dict[Path, str] = {}   # lock files this process holds -> their content


class RunDirError(UserError):
    """The output directory cannot be used (locked, holds another run, not writable)."""


# ----------------------------------------------------------------- fingerprint
def may_change_on_resume(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE_ON_RESUME)


def run_defining(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The run-defining part of a flat ``{dotted key: value}`` config."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()
            if not may_change_on_resume(k)}


def fingerprint(cfg) -> str:
    """SHA-256 (hex) of the canonical JSON of the run-defining config keys."""
    text = json.dumps(run_defining(_flat(cfg.to_dict())), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_run(cfg, stored_fingerprint: Optional[str], stored_yaml: Optional[str],
                   source: Path) -> None:
    """Raise :class:`RunDirError` naming the first run-defining key that differs from
    the run stored in ``source`` (a checkpoint or a log)."""
    if stored_fingerprint is None or stored_fingerprint == fingerprint(cfg):
        return
    key = "an unknown key"
    if stored_yaml:
        import yaml

        try:
            old = run_defining(_flat(yaml.safe_load(stored_yaml)))
        except yaml.YAMLError:
            old = {}
        new = run_defining(_flat(cfg.to_dict()))
        diff = [k for k in new if new[k] != old.get(k)]
        if diff:
            key = f"{diff[0]!r} ({old.get(diff[0])!r} there, {new[diff[0]]!r} now)"
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


def resume_history(log_path: Path, ckpt_path: Path, rounds: int, cfg) -> list[dict]:
    """Rounds < ``rounds`` of the log to resume, as ``Federation.history`` rows.

    The log must belong to the same run as the checkpoint (fingerprint) and hold
    every round the checkpoint covers; else :class:`RunDirError` (exit 2)."""
    from .log import read

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


# ----------------------------------------------------------------------- lock
def _start_time(pid: int) -> Optional[str]:
    """Start time of process ``pid`` (field 22 of /proc/pid/stat, clock ticks since
    boot), or None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _lock_text() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()} {pid} {_start_time(pid) or '-'} {time.time():.0f}\n"


def _holder(text: str) -> tuple[str, int, str, float]:
    host, pid, start, since = text.split()
    return host, int(pid), start, float(since)


def _stale(text: str) -> bool:
    """A lock of a process that is gone (only decidable on this host)."""
    try:
        host, pid, start, _ = _holder(text)
    except ValueError:
        return True   # an unfinished or foreign write: no holder to respect
    if host != socket.gethostname():
        return False
    if not pid_alive(pid):
        return True
    now = _start_time(pid)
    return start != "-" and now is not None and now != start


def acquire(out: Path) -> Optional[str]:
    """Take ``<out>/.fedmpi.lock``; returns the stale holder it replaced (or None)."""
    path = Path(out) / LOCK_NAME
    text = _lock_text()
    replaced = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                old = path.read_text()
            except FileNotFoundError:
                continue   # released meanwhile
            if not _stale(old):
                host, pid, _, since = _holder(old)
                raise RunDirError(
                    f"{out}: another fedmpi run is writing here (pid {pid} on host {host}, "
                    f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}; lock "
                    f"file {path}); wait for it, use another --out, or remove the lock file if "
                    "that process is gone") from None
            replaced = old.strip() or "an empty lock"
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(text)
        _held[path] = text
        return replaced
    raise RunDirError(f"{out}: cannot take the lock {path} (it keeps changing)")


def release() -> None:
    """Remove every lock this process holds (if still ours)."""
    for path, text in list(_held.items()):
        try:
            if path.read_text() == text:
                path.unlink()
        except OSError:
            pass
        del _held[path]


# -------------------------------------------------------------------- prepare
@dataclass
class RunDir:
    """An output directory that this process owns until :func:`release`."""

    path: Path
    fingerprint: str
    stale_lock: Optional[str] = None   # the dead holder whose lock was taken over


def prepare(out: str | os.PathLike, cfg, resume: bool, overwrite: bool) -> RunDir:
    """Rank 0, before anything is written: lock ``out`` and apply the conventions of
    the module docstring. Raises :class:`RunDirError` (exit 2)."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: continue the run in "
                          f"{out}, or replace it")
    path = output_dir(out)
    stale = acquire(path)
    try:
        present = [name for name in RUN_FILES if (path / name).exists()]
        if resume and not (path / "checkpoint.pt").exists() and (path / "log.h5").exists():
            raise RunDirError(f"{path / 'checkpoint.pt'}: missing, but {path / 'log.h5'} holds a "
                              "run that stopped before its first checkpoint; nothing to resume: "
                              "start it again with --overwrite (no --resume)")
        if not resume and present:
            if not overwrite:
                raise RunDirError(f"{path}: holds a previous run ({', '.join(present)}); "
                                  "continue it with --resume, replace it with --overwrite, or "
                                  "use another --out")
            for pattern in RUN_FILES + _SIDE_FILES:
                for old in path.glob(pattern):
                    old.unlink()
    except BaseException:
        release()
        raise
    return RunDir(path, fingerprint(cfg), stale)
