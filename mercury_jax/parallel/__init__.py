"""Device meshes and the logical-axis -> mesh-axis rules that shard parameters by name."""
from mercury_jax.parallel.mesh import MESH_AXES, make_mesh, mesh_axis_sizes, mesh_of, with_mesh_context
from mercury_jax.parallel.per_shard import per_shard
from mercury_jax.parallel.sharding import (
                                           BATCH_LENGTH_EMBED,
                                           DEFAULT_RULES,
                                           constrain,
                                           copy_into,
                                           init_sharded,
                                           logical_partition_spec,
                                           param_shardings,
                                           partitioned_mesh,
                                           shard_params,
                                           variable_sharding,
)

__all__ = ["BATCH_LENGTH_EMBED", "DEFAULT_RULES", "MESH_AXES", "constrain", "copy_into", "init_sharded",
           "logical_partition_spec", "make_mesh", "mesh_axis_sizes", "mesh_of", "param_shardings", "partitioned_mesh",
           "per_shard", "shard_params", "variable_sharding", "with_mesh_context"]
