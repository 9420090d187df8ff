"""Device meshes and the logical-axis -> mesh-axis rules that shard parameters by name."""
from mercury_jax.parallel.mesh import MESH_AXES, make_mesh
from mercury_jax.parallel.sharding import (
                                           DEFAULT_RULES,
                                           logical_partition_spec,
                                           param_shardings,
                                           shard_params,
                                           variable_sharding,
)

__all__ = ["DEFAULT_RULES", "MESH_AXES", "logical_partition_spec", "make_mesh", "param_shardings", "shard_params",
           "variable_sharding"]
