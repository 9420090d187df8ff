"""The platform a program is being traced for: the devices of the mesh it traces under, else the default backend.

An ahead-of-time compile for TPU on a CPU host traces under a mesh of TPU devices while `jax.default_backend()` is
"cpu"; the kernel choices ("auto": Pallas GDN, ragged expert dispatch) and Pallas interpret mode follow the mesh.
"""
from __future__ import annotations

import jax


def target_platform(mesh=None) -> str:
    """"tpu", "cpu", "gpu": the platform of `mesh`'s devices (a `Mesh` or `AbstractMesh`; default: the mesh context),
    or `jax.default_backend()` when there is none."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if isinstance(mesh, jax.sharding.Mesh):
        mesh = mesh.abstract_mesh
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()
