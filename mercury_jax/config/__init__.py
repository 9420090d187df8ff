"""The config rules in one place: the pipeline registry, defaults of fields older configs lack, the range table,
the checks run before any work (common and each pipeline's own), and what a config's sections name (the roles'
meshes, the model, the rollout layout). Imports nothing from `train` or `runs`."""
