"""Configuration: declaring keys (:mod:`~fedmpi.config.fields`, components' parameter
blocks in :mod:`~fedmpi.config.params`), reading and merging them
(:mod:`~fedmpi.config.core`, :mod:`~fedmpi.config.yaml_dialect`), the framework's own
sections (:mod:`~fedmpi.config.framework`) and the run's schema assembled from those and
the registered components (:mod:`~fedmpi.config.schema`)."""
