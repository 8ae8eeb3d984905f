"""The chassis: the torch-side operations every method uses (the learner, rollouts, the online methods' shared
stages, the run's bookkeeping, models, generation, data, checkpoints, ranks, tensor ops). It imports no method:
methods build on the chassis, never the reverse."""
