"""The run directory and its I/O: the layout of a workdir, checkpoints (by role, with their faults named), the
reader of a finished or running run, resume checks, the workdir lock and the peer guard, preemption. Below the
algorithms (`mercury_jax.train`), above the config rules (`mercury_jax.config`)."""
