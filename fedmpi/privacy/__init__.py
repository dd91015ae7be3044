"""Privacy: secure aggregation (:mod:`.secagg`)."""
