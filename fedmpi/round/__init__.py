"""Round policies: who trains from which model version, when a step is applied, and the clocks."""
