"""Weight update into a thawed engine: the trainer's layout mapped onto the engine's
(:mod:`vitrify.weights.mapping`)."""
