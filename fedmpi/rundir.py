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

import contextlib
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
from .safefile import create_temp, refuse_links

LOCK_NAME = ".fedmpi.lock"
#: Files whose presence means "a previous run lives here".
RUN_FILES = ("log.h5", "checkpoint.pt", "model.pt")
#: Also removed by ``--overwrite`` (glob patterns).
_SIDE_FILES = ("config.yaml", ".checkpoint.pt.tmp-*", ".model.pt.tmp-*", ".log.h5.tmp-*",
               ".config.yaml.tmp-*")
#: Every name fedmpi writes in a run directory: none of them may be a symbolic link.
WRITTEN = (LOCK_NAME, *RUN_FILES, *_SIDE_FILES, "report")

#: Config keys (``fnmatch`` patterns) that may differ between a checkpoint and the run
#: resuming it: how long to run, where the data lives, how to evaluate, how to execute.
#: Everything else defines the run (seed, data, partition, model, method, weighting,
#: adversaries ...) and is in the fingerprint.
MAY_CHANGE_ON_RESUME = ("name", "train.rounds", "data.root", "data.download", "eval.*",
                        "runtime.*")

class RunDirError(UserError):
    """The output directory cannot be used (locked, holds another run, not writable)."""


# ----------------------------------------------------------------- fingerprint
def may_change_on_resume(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE_ON_RESUME)


def run_defining(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The run-defining part of a flat ``{dotted key: value}`` config."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()
            if not may_change_on_resume(k)}


def _default(key: str) -> Any:
    """The schema default of ``key`` (a unique sentinel for keys outside the schema)."""
    from .config import SCHEMA

    field = SCHEMA.get(key)
    if field is None:
        return _NO_DEFAULT
    return list(field.default) if isinstance(field.default, tuple) else field.default


_NO_DEFAULT = object()


def fingerprint(cfg) -> str:
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


def check_same_run(cfg, stored_fingerprint: Optional[str], stored_yaml: Optional[str],
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
#: A lock whose heartbeat is older than this many of its holder's
#: ``runtime.round_timeout`` is stale, also on another host (a live run refreshes it
#: every round, and a round longer than ``round_timeout`` aborts the run).
LOCK_STALE_FACTOR = 3


@dataclass(frozen=True)
class LockHolder:
    """Who holds ``<out>/.fedmpi.lock`` (the file's text) and its last heartbeat.

    The text is ``host pid start-time since round_timeout`` (one line, written before
    the file gets its name, so nobody ever reads half of it); the heartbeat is the
    file's modification time, refreshed by :func:`heartbeat`."""

    host: str
    pid: int
    start: str               # /proc start time of the pid ("-" where unknown)
    since: float             # Unix time the lock was taken
    round_timeout: float     # the holder's runtime.round_timeout
    heartbeat: float         # Unix time of the last refresh (the file's mtime)
    text: str = ""

    @property
    def stale_after(self) -> float:
        """Seconds without a heartbeat after which the lock is stale on any host."""
        return LOCK_STALE_FACTOR * self.round_timeout

    def stale(self, now: Optional[float] = None) -> bool:
        """Whether the holder is gone: on this host the pid is dead (or reused by a
        process started at another time); anywhere, no heartbeat for
        :attr:`stale_after` seconds (hosts' clocks must agree to well within that)."""
        age = (time.time() if now is None else now) - self.heartbeat
        if age > self.stale_after:
            return True
        if self.host != socket.gethostname():
            return False
        if not pid_alive(self.pid):
            return True
        started = _start_time(self.pid)
        return self.start != "-" and started is not None and started != self.start

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return (f"pid {self.pid} on host {self.host}, since {when}, last heartbeat "
                f"{max(0.0, time.time() - self.heartbeat):.0f} s ago")


@dataclass
class _Held:
    fd: int
    text: str


_held: dict[Path, _Held] = {}   # lock files this process holds


def _start_time(pid: int) -> Optional[str]:
    """Start time of process ``pid`` (field 22 of /proc/pid/stat, clock ticks since
    boot), or None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _lock_text(round_timeout: float) -> str:
    pid = os.getpid()
    return (f"{socket.gethostname()} {pid} {_start_time(pid) or '-'} {time.time():.0f} "
            f"{float(round_timeout):g}\n")


def parse_lock(text: str, heartbeat: float) -> LockHolder:
    """The holder described by a lock file's text (ValueError if it is not one). Locks
    of fedmpi before issue 30 lack ``round_timeout``: the default 600 s is assumed."""
    fields = text.split()
    if len(fields) not in (4, 5):
        raise ValueError(f"not a fedmpi lock: {text[:80]!r}")
    timeout = float(fields[4]) if len(fields) == 5 else 600.0
    return LockHolder(fields[0], int(fields[1]), fields[2], float(fields[3]), timeout,
                      heartbeat, text.strip())


def lock_holder(out: str | os.PathLike) -> Optional[LockHolder]:
    """The holder of ``<out>/.fedmpi.lock``, or None where there is no (readable) lock.
    A file that is not a lock reads as a holder that is long gone."""
    path = Path(out) / LOCK_NAME
    try:
        st = os.stat(path, follow_symlinks=False)
        text = path.read_text()
    except (FileNotFoundError, PermissionError):
        return None
    try:
        return parse_lock(text, st.st_mtime)
    except ValueError:
        return LockHolder("?", 0, "-", st.st_mtime, 0.0, 0.0, text.strip())


def _flock(fd: int, block: bool) -> Optional[bool]:
    """``flock(LOCK_EX)``: True taken, False held by another open file, None where the
    file system does not support it (NFS without lockd, Lustre without ``-o flock``)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _publish(path: Path, text: str) -> Optional[int]:
    """Create ``path`` holding ``text`` atomically: write a private temporary file, then
    ``link(2)`` it to ``path``, which fails if ``path`` exists (``O_EXCL`` semantics that
    also hold on NFS). Returns an fd of the new lock, or None if ``path`` exists."""
    fd, tmp = create_temp(path, readable=True)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
        return fd
    finally:
        os.unlink(tmp)


def _busy(out: Path, holder: LockHolder) -> RunDirError:
    return RunDirError(
        f"{out}: another fedmpi run is writing here ({holder.describe()}; lock file "
        f"{out / LOCK_NAME}); wait for it, or use another --out (the lock is stale, and taken "
        f"over, {holder.stale_after:g} s after its last heartbeat)")


def _foreign_stale(out: Path, st: os.stat_result) -> RunDirError:
    return RunDirError(
        f"{out / LOCK_NAME}: left by a run of user {_user(st.st_uid)} that is gone; you "
        f"({_user(os.geteuid())}) may not remove it here: ask {_user(st.st_uid)} or an "
        "administrator to remove it, or use another --out")


def acquire(out: str | os.PathLike, round_timeout: float = 600.0) -> Optional[str]:
    """Take ``<out>/.fedmpi.lock``; returns the text of the stale lock it took over (or
    None). Raises :class:`RunDirError` when a live run holds it.

    Atomic: a fresh lock is published with ``link(2)`` (exactly one of any number of
    racing processes succeeds); the holder keeps an ``flock`` on it for its lifetime,
    and a stale lock is taken over only by the process that gets that ``flock`` and
    finds the holder gone (module docstring; NFS and Lustre in docs/cluster.md)."""
    out = Path(out)
    path = out / LOCK_NAME
    text = _lock_text(round_timeout)
    for _ in range(100):
        fd = _publish(path, text)
        if fd is not None:
            _flock(fd, block=True)   # a racer may hold it for a moment to read the text
            _held[path] = _Held(fd, text)
            return None
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
        except FileNotFoundError:
            continue   # released meanwhile
        except PermissionError:
            holder, st = lock_holder(out), os.stat(path, follow_symlinks=False)
            if holder is not None and not holder.stale():
                raise _busy(out, holder) from None
            raise _foreign_stale(out, st) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RunDirError(f"{path}: is a symbolic link; fedmpi never makes links in a "
                                  "run directory: remove it") from None
            raise
        try:
            taken = _flock(fd, block=False)
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            continue
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            os.close(fd)   # released and re-created meanwhile
            continue
        old = os.pread(fd, 4096, 0).decode(errors="replace")
        try:
            holder = parse_lock(old, st.st_mtime)
        except ValueError:
            holder = None
        if taken is False or (holder is not None and not holder.stale()):
            os.close(fd)
            if holder is None:
                holder = lock_holder(out) or LockHolder("?", 0, "-", 0.0, 0.0, 0.0)
            raise _busy(out, holder)
        if taken is None:
            # no flock here: set the stale lock aside (rename is atomic), then race to
            # publish a new one; a racer that set aside a *live* lock puts it back
            os.close(fd)
            aside = path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if aside.read_text() != old:
                with contextlib.suppress(OSError):
                    os.link(aside, path)
                aside.unlink()
                continue
            aside.unlink()
            fd = _publish(path, text)
            if fd is None:
                continue
            _held[path] = _Held(fd, text)
            return old.strip() or "an empty lock"
        os.ftruncate(fd, 0)   # ours now: the flock excludes every other taker
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)
        os.utime(fd)
        _held[path] = _Held(fd, text)
        return old.strip() or "an empty lock"
    raise RunDirError(f"{out}: cannot take the lock {path} (it keeps changing)")


def heartbeat() -> None:
    """Refresh the modification time of every lock this process holds (rank 0, every
    round): what tells a run on another host that this one is alive."""
    for held in _held.values():
        with contextlib.suppress(OSError):
            os.utime(held.fd)


def release() -> None:
    """Remove every lock this process holds (if still ours)."""
    for path, held in list(_held.items()):
        try:
            if os.pread(held.fd, 4096, 0).decode(errors="replace") == held.text:
                st, now = os.fstat(held.fd), os.stat(path, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                    path.unlink()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.close(held.fd)
        del _held[path]


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


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
        raise RunDirError(f"{path}: holds a run of user {_user(uid)} ({', '.join(files)}), which "
                          f"you ({_user(me)}) may not replace or continue here: use another "
                          f"--out, or ask {_user(uid).split()[0]} to remove those files")
