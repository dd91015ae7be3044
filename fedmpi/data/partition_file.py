"""Reading, checking and writing user-supplied partitions (``data.partition.method: file``).

Two formats, chosen by the file suffix:

``.json``
    Either a list with one list of training-pool indices per client::

        [[0, 5, 7], [1, 2], ...]

    or an object with the client lists and an optional server hold-out::

        {"clients": [[0, 5, 7], [1, 2], ...], "validation": [3, 4]}

``.npz``
    Integer arrays ``client_0``, ``client_1``, ... and optionally ``validation``.

Indices must lie in ``[0, N)`` for a pool of ``N`` samples, and no index may
appear twice (in one client, in two clients, or in a client and the
validation list).
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Any

import numpy as np

from fedmpi.data.base import npz_member
from fedmpi.errors import DataError

__all__ = ["check_partition", "read_partition_file", "write_partition_file"]

_NPZ_CLIENT = re.compile(r"client_(\d+)")


def _as_indices(value: Any, path: str, what: str) -> np.ndarray:
    """A flat list/array of integers -> int64 array, or DataError naming ``what``."""
    # JSON true/false are Python bools, which numpy would silently turn into 1/0.
    if isinstance(value, list) and any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise DataError(
            f"data.partition.file={path!r}: {what} must be a flat list of integer "
            f"training-pool indices"
        )
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(
            f"data.partition.file={path!r}: {what} must be a flat list of integer "
            f"training-pool indices"
        )
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:   # would wrap
        raise DataError(f"data.partition.file={path!r}: {what} has index {int(arr.max())}, "
                        "which is no training-pool index")
    return arr.astype(np.int64)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique (``json`` would keep the last of a repeat)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _read_json(path: str) -> tuple[list[np.ndarray], np.ndarray | None]:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            obj = json.load(fh, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise DataError(f"data.partition.file={path!r}: key {exc.args[0]!r} appears twice in one "
                        "JSON object (JSON readers disagree on which one counts); write it once"
                        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"data.partition.file={path!r} is not valid JSON ({exc})") from None
    except RecursionError:
        raise DataError(f"data.partition.file={path!r}: JSON nested too deeply; expected a list "
                        "of per-client index lists") from None
    except OSError as exc:
        raise DataError(f"data.partition.file={path!r}: cannot read ({exc.strerror})") from None
    validation = None
    if isinstance(obj, dict):
        unknown = sorted(set(obj) - {"clients", "validation"})
        if unknown or "clients" not in obj:
            raise DataError(
                f"data.partition.file={path!r}: expected an object with keys 'clients' "
                f"(required) and 'validation' (optional), found keys {sorted(obj)}"
            )
        if obj.get("validation") is not None:
            validation = _as_indices(obj["validation"], path, "'validation'")
        obj = obj["clients"]
    if not isinstance(obj, list) or not all(isinstance(c, list) for c in obj):
        raise DataError(
            f"data.partition.file={path!r}: expected a list of per-client index lists "
            f"(or {{\"clients\": [...], \"validation\": [...]}})"
        )
    clients = [_as_indices(c, path, f"client {k}") for k, c in enumerate(obj)]
    return clients, validation


def _read_npz(path: str) -> tuple[list[np.ndarray], np.ndarray | None]:
    try:
        npz = np.load(os.path.expanduser(path), allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"data.partition.file={path!r} is not a readable .npz file ({exc})") from None
    with npz:
        numbers = {}
        for key in npz.files:
            match = _NPZ_CLIENT.fullmatch(key)
            if match:
                numbers[int(match.group(1))] = key
            elif key != "validation":
                raise DataError(
                    f"data.partition.file={path!r}: unexpected array {key!r}; "
                    f"expected client_0, client_1, ... and optionally 'validation'"
                )
        if sorted(numbers) != list(range(len(numbers))):
            raise DataError(
                f"data.partition.file={path!r}: client arrays must be named client_0 .. "
                f"client_{len(numbers) - 1} without gaps, found {sorted(numbers.values())}"
            )
        where = f"data.partition.file={path!r}"
        clients = [_as_indices(npz_member(npz, numbers[k], where), path, numbers[k])
                   for k in range(len(numbers))]
        validation = (
            _as_indices(npz_member(npz, "validation", where), path, "'validation'")
            if "validation" in npz.files else None
        )
    return clients, validation


def read_partition_file(path: str) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Parse a partition file into per-client index arrays and the optional validation list.

    Only the format is checked here; :func:`check_partition` checks the
    indices against the pool.
    """
    if not os.path.isfile(os.path.expanduser(path)):
        raise DataError(f"data.partition.file={path!r} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".npz":
        return _read_npz(path)
    raise DataError(f"data.partition.file={path!r}: the name must end in .json or .npz")


def check_partition(
    clients: list[np.ndarray],
    validation: np.ndarray | None,
    pool_size: int,
    num_clients: int,
    source: str,
) -> None:
    """Raise DataError unless the lists form a valid partition of part of the pool.

    Checks: ``len(clients) == num_clients``; every index in ``[0, pool_size)``;
    no index listed twice anywhere. ``source`` names the file in messages.
    """
    where = f"data.partition.file={source!r}"
    if len(clients) != num_clients:
        raise DataError(
            f"{where} lists {len(clients)} clients but data.num_clients={num_clients}; "
            f"make them equal"
        )
    lists = list(clients) + ([validation] if validation is not None else [])
    for owner, ix in enumerate(lists):
        bad = ix[(ix < 0) | (ix >= pool_size)]
        if bad.size:
            name = f"client {owner}" if owner < num_clients else "the validation list"
            raise DataError(
                f"{where}: {name} has index {int(bad[0])} outside the training pool "
                f"[0, {pool_size})"
            )
    if not lists:
        return
    indices = np.concatenate(lists)
    owners = np.concatenate([np.full(len(ix), k, dtype=np.int64) for k, ix in enumerate(lists)])
    order = np.argsort(indices, kind="stable")
    indices, owners = indices[order], owners[order]
    dup = np.flatnonzero(indices[1:] == indices[:-1])
    if dup.size:
        i = int(dup[0])
        index, a, b = int(indices[i]), int(owners[i]), int(owners[i + 1])
        if a == b:
            name = f"client {a}" if a < num_clients else "the validation list"
            problem = f"appears twice in {name}"
        elif b < num_clients:
            problem = f"appears in clients {a} and {b}"
        else:
            problem = f"appears in client {a} and in the validation list"
        raise DataError(f"{where}: index {index} {problem}; every index may be used once")


def write_partition_file(
    path: str, clients: list[np.ndarray], validation: np.ndarray
) -> None:
    """Write ``clients`` and ``validation`` in the format of ``path``'s suffix (.json or .npz)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".json":
        obj = {
            "clients": [np.asarray(c).tolist() for c in clients],
            "validation": np.asarray(validation).tolist(),
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(obj, fh)
    elif suffix == ".npz":
        arrays = {f"client_{k}": np.asarray(c, dtype=np.int64) for k, c in enumerate(clients)}
        arrays["validation"] = np.asarray(validation, dtype=np.int64)
        np.savez(path, **arrays)  # type: ignore[arg-type]  # numpy stubs: kwds typed as bool
    else:
        raise DataError(f"cannot write partition to {path!r}: the name must end in .json or .npz")
