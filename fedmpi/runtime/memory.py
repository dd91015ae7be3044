"""A model too large for the machine is refused before it is built.

The model is first built on PyTorch's ``meta`` device (shapes only, no storage, the global
RNG states restored afterwards, so the real build draws the same weights). Every rank then
needs at least

    need = 4 bytes × every parameter and float buffer (the model in float32)
         + 12 bytes × every exchanged entry (the global state θ and the float64 sum)

— a lower bound on what the round holds (:mod:`fedmpi.runtime.server`, docs/performance.md),
so a refusal is never wrong. If it exceeds the memory available to the process
(``MemAvailable`` of ``/proc/meminfo``, and the cgroup's ``memory.max`` less its
``memory.current`` where one is set) on any rank, every rank stops with one line naming
``model.name``, the parameter count and both sizes (exit 2), instead of being killed for
memory while building or in round 0. A factory that cannot build on ``meta`` (one that
reads weight files into fixed storage, say) skips the check.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from fedmpi.comm.world import Comm
from fedmpi.errors import ConfigError

GIB = float(1 << 30)


def available_bytes() -> Optional[int]:
    """Memory this process may still take: MemAvailable, capped by the cgroup (v2) limit;
    None where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def shapes_only(make: Callable[[], nn.Module]) -> Optional[tuple[int, int]]:
    """(all parameters and float buffers, exchanged entries = trainable parameters + float
    buffers) of ``make()`` built on the meta device; None when it cannot be."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = make()
    except Exception:  # noqa: BLE001 - the real build reports the factory's own errors
        return None
    params = list(model.parameters())
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return (sum(p.numel() for p in params) + buffers,
            sum(p.numel() for p in params if p.requires_grad) + buffers)


def check_fits(comm: Comm, make: Callable[[], nn.Module],
               available: Callable[[], Optional[int]] = available_bytes) -> None:
    """Collective: refuse (:class:`~fedmpi.errors.ConfigError`) on every rank when the
    model's lower bound exceeds the memory of any rank (module docstring)."""
    sizes = shapes_only(make)
    have = available()
    short = 0
    if sizes is not None and have is not None:
        total, exchanged = sizes
        need = 4 * total + 12 * exchanged
        short = max(0, need - have)
    short = comm.max_int(short, what="memory check")
    if short and sizes is None:
        raise ConfigError("config key 'model.name': the model needs more memory than another "
                          "rank has available")
    if short and sizes is not None:
        total, exchanged = sizes
        need = 4 * total + 12 * exchanged
        raise ConfigError(f"config key 'model.name': the model has {total:,} parameters and "
                          f"buffers ({exchanged:,} exchanged); a rank needs at least "
                          f"{need / GIB:.1f} GiB (4 bytes each + 12 per exchanged entry) but "
                          f"its machine has {(need - short) / GIB:.1f} GiB available")
