"""Local training on one rank: the model as one flat vector (:mod:`~fedmpi.training.flat`),
the one local loop (:mod:`~fedmpi.training.loop`), optimizers on the flat vector
(:mod:`~fedmpi.training.optim`) and the opt-in speed switches (:mod:`~fedmpi.training.accel`)."""
