"""fedmpi: MPI-native federated learning for cross-silo training.

``fedmpi.run(config, ...)`` runs an experiment from Python (:mod:`fedmpi.api`); it raises
:class:`ConfigError` (bad input) and :class:`RunFailed` (a run that failed), never
``SystemExit``.
"""
from __future__ import annotations

from fedmpi._version import __version__


from fedmpi.errors import ConfigError, RunFailed, RunInterrupted, UserError  # noqa: E402 - light


def __getattr__(name: str):
    # Lazy: `import fedmpi` (and `fedmpi check`) stay light; fedmpi.run pulls in torch.
    if name in ("run", "RunResult"):
        from fedmpi import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedmpi' has no attribute {name!r}")


__all__ = ["ConfigError", "RunFailed", "RunInterrupted", "RunResult", "UserError", "__version__",
           "run"]
