"""dp-accounting's harmless non-convergence warning, kept off stderr.

dp-accounting's RDP accountant logs (through absl) ``_compute_log_a_frac failed to
converge after 1000 iterations ... Excluding this order from the epsilon
computation`` for each fractional RDP order whose series it cannot sum, and leaves
that order out: ε is then the minimum over the remaining orders, each of which is a
valid bound, so the reported ε stays an upper bound (harmless by the library's own
account). About ten such lines per record-level run alarm a reader, so
:func:`install` drops exactly that message from the ``absl`` logger; every other absl
record (other warnings, errors) still reaches the handlers.
"""
from __future__ import annotations

import logging

__all__ = ["install"]

#: The start of the one message dropped (dp_accounting.rdp.rdp_privacy_accountant).
NON_CONVERGENCE = "_compute_log_a_frac failed to converge"


class _DropNonConvergence(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(NON_CONVERGENCE))


def install() -> None:
    """Add the filter to the ``absl`` logger (idempotent)."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropNonConvergence) for f in logger.filters):
        logger.addFilter(_DropNonConvergence())
