"""What a consortium reviews across its sites, computed where the data lives.

- :mod:`~fedmpi.consortium.stats` — ``fedmpi stats CONFIG``: federated statistics of
  every site's data in one collective pass (only summaries leave a site);
- :mod:`~fedmpi.consortium.summaries` — one site's summary row and what rank 0 makes of it;
- :mod:`~fedmpi.consortium.noise` — optional Gaussian noise on the rows, (ε, δ) from
  ``dp-accounting``;
- :mod:`~fedmpi.consortium.stats_files` — ``stats.md`` and ``stats.json``.

Cross-site validation (every site's model on every site's held-out data) belongs here
too, once the runtime's evaluation offers the seam for it.
"""
