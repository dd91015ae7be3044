"""fedmpi: MPI-native federated learning for cross-silo training."""
from __future__ import annotations

__version__ = "0.1.0"
