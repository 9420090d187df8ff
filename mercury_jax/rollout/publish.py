"""The learner's weights published into every rollout replica by two compiled programs of device-to-device collectives.

    publisher = Publisher(replica_meshes, param_dtype="bfloat16")
    per_replica = publisher(params)        # params on the source (actor) mesh -> one weights tree per replica

The A source devices (the mesh the params live on) are viewed as C = A / S copies of a replica's mesh of S devices
(device i of the source mesh is device i mod S of copy i // S, by the meshes' flat device order). Two programs:

1. on the source devices (`stage`): every floating leaf cast to the rollout dtype and laid out as C stacked copies,
   each split like a replica's weights (`parallel.param_shardings` on the replica's axes): [C * d0, d1, ...] with
   dim 0 over ("group", replica axes of d0). XLA's reshard from the learner's layout is collectives among the source
   devices.
2. on the union mesh ("group" = C + R, then the replica's axes) of the source and the R replicas' devices (`send`):
   group g < C holds copy g, group C + r is replica r's devices, holding a destination buffer (donated, so the
   output takes its place). Round j = 0 .. ceil(R / C) - 1 is one collective-permute along "group" that sends copy c
   to replica j C + c, device (c, k) to device (C + j C + c, k): replica r's device k receives exactly its share.

Replica r's weights are then the output's shards on its devices, wrapped as arrays of its mesh (no copy). Per publish
a rollout chip receives the bytes of its share (the cast weights / S, replicated leaves whole) and a source chip
sends ceil(R / C) times its copy's share; no byte passes through host memory and no fp32 master lands on a rollout
device (memory per chip of both programs at the released size: BENCHMARKS.md "publish_aot"). Both are ordinary SPMD
programs, so every process of a multi-host run can call them alike, where a cross-process `jax.device_put` is
refused.

`Publisher.supports(params)` says when this applies: the params sit on one mesh whose devices are disjoint from the
replicas' and whose size is a multiple of S. Otherwise (one shared device, overlapping groups) `rollout_weights`'s
cast + `device_put` per replica is the route.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.parallel import mesh_of, param_shardings
from mercury_jax.rollout.layout import rollout_dtype

GROUP = "group"  # the union mesh's leading axis: C source copies, then R replicas


def _axes(entry) -> tuple:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def stacked_spec(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    """A replica leaf's spec for C (or C + R) copies stacked along dim 0: dim 0 over ("group", its own axes)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return PartitionSpec((GROUP, *_axes(entries[0])), *entries[1:])


class Publisher:
    """Publishes weights from a source mesh into `replica_meshes` (equal shapes, disjoint devices) by collectives."""

    def __init__(self, replica_meshes: Sequence[Mesh], param_dtype=None):
        self.replica_meshes = list(replica_meshes)
        shapes = {m.devices.shape for m in self.replica_meshes}
        if not self.replica_meshes or len(shapes) != 1 or len({m.axis_names for m in self.replica_meshes}) != 1:
            raise ValueError("Publisher needs one or more replica meshes of one shape and axis order")
        self.param_dtype = param_dtype or None
        self._replica_devices = {d for m in self.replica_meshes for d in m.devices.flat}
        self._programs: dict = {}

    @property
    def replica_size(self) -> int:
        return self.replica_meshes[0].size

    def supports(self, params) -> bool:
        """True when `params` all lie on one mesh of a multiple of S devices, none of them a replica's."""
        source = _source_mesh(params)
        if source is None or source.size % self.replica_size:
            return False
        return not self._replica_devices & set(source.devices.flat)

    def __call__(self, params) -> list:
        """One weights tree per replica (the structure of `params`, cast, in the replica's layout)."""
        if not self.supports(params):
            raise ValueError("Publisher: the params must lie on one mesh of a multiple of the replica size, disjoint "
                             "from the rollout replicas' devices; use layout.rollout_weights otherwise")
        programs = self._programs_for(params)
        staged = programs.stage(params)
        placeholders = programs.destinations()
        leaves = [_union_array(s, p, programs.union, spec)
                  for s, p, spec in zip(staged, placeholders, programs.union_specs)]
        del staged, placeholders
        received = programs.send(leaves)
        del leaves
        trees = []
        for mesh, shardings in zip(self.replica_meshes, programs.replica_shardings):
            trees.append(jax.tree.unflatten(programs.treedef, [
                _replica_array(out, sharding, mesh, shape)
                for out, sharding, shape in zip(received, shardings, programs.shapes)]))
        return trees

    def lower(self, params):
        """The two programs lowered for abstract `params` (ShapeDtypeStructs with shardings on the source mesh),
        as (stage, send): what the AOT benchmark compiles."""
        programs = self._programs_for(params)
        abstract_union = [jax.ShapeDtypeStruct((programs.copies_total * leaf.shape[0], *leaf.shape[1:]),
                                               rollout_dtype(leaf.dtype, self.param_dtype),
                                               sharding=NamedSharding(programs.union, spec))
                          for leaf, spec in zip(jax.tree.leaves(params), programs.union_specs)]
        return programs.stage.lower(params), programs.send.lower(abstract_union)

    def _programs_for(self, params) -> _Programs:
        leaves, treedef = jax.tree.flatten(params)
        key = (treedef, tuple((leaf.shape, str(leaf.dtype), leaf.sharding) for leaf in leaves))
        if key not in self._programs:
            self._programs[key] = _Programs(params, _source_mesh(params), self.replica_meshes, self.param_dtype)
        return self._programs[key]


class _Programs:
    """The compiled pieces of one publish for one params structure and source layout."""

    def __init__(self, params, source: Mesh, replica_meshes: list[Mesh], param_dtype):
        leaves, self.treedef = jax.tree.flatten(params)
        if any(leaf.ndim == 0 for leaf in leaves):
            raise ValueError("Publisher: scalar weights are not supported (stack them into a 1-D leaf)")
        self.shapes = [leaf.shape for leaf in leaves]
        first = replica_meshes[0]
        names, grid = first.axis_names, first.devices.shape
        copies, replicas = source.size // first.size, len(replica_meshes)
        self.copies_total = copies + replicas
        staging = Mesh(np.asarray(list(source.devices.flat), dtype=object).reshape(copies, *grid), (GROUP, *names))
        destination = Mesh(np.stack([m.devices for m in replica_meshes]), (GROUP, *names))
        self.union = Mesh(np.concatenate([staging.devices, destination.devices]), (GROUP, *names))
        self.replica_shardings = [jax.tree.leaves(param_shardings(params, mesh)) for mesh in replica_meshes]
        self.union_specs = [stacked_spec(s.spec, leaf.ndim) for s, leaf in zip(self.replica_shardings[0], leaves)]
        dtypes = [rollout_dtype(leaf.dtype, param_dtype) for leaf in leaves]

        replica_specs = [s.spec for s in self.replica_shardings[0]]
        # the interim re-split only from a source split along one axis (fsdp: the released actor), where XLA would
        # otherwise gather whole leaves; from a multi-axis source (e.g. fsdp x expert x tensor) the copies' layout is
        # the source's minus some axes (an all-gather), and a re-split over every axis first makes XLA gather whole
        # leaves instead (Qwen3.5-397B-A17B: 1.5 TB of temporaries, BENCHMARKS "pod")
        one_axis = sum(size > 1 for size in source.shape.values()) <= 1
        interim = [_interim_sharding(spec, first, leaf.shape, source) if one_axis else None
                   for spec, leaf in zip(replica_specs, leaves)]

        def stage(tree):
            # Each leaf is first split over all source devices along the dim the replica splits (one all-to-all),
            # then copied along a leading copy axis laid out explicitly and folded into dim 0 (a permute and an
            # all-gather of a replica's share). Left to itself XLA gathers whole leaves onto every source device.
            out = []
            for leaf, dtype, spec, step in zip(jax.tree.leaves(tree), dtypes, replica_specs, interim):
                leaf = leaf.astype(dtype)
                if step is not None:
                    leaf = jax.lax.with_sharding_constraint(leaf, step)
                copied = jnp.broadcast_to(leaf[None], (copies, *leaf.shape))
                copied = jax.lax.with_sharding_constraint(copied, NamedSharding(staging, PartitionSpec(GROUP, *spec)))
                out.append(copied.reshape(copies * leaf.shape[0], *leaf.shape[1:]))
            return out

        self.stage = jax.jit(stage, out_shardings=[NamedSharding(staging, s) for s in self.union_specs])
        self.destinations = jax.jit(
            lambda: [jnp.zeros((replicas * shape[0], *shape[1:]), dtype) for shape, dtype in zip(self.shapes, dtypes)],
            out_shardings=[NamedSharding(destination, s) for s in self.union_specs])

        self.send = _send_program(self.union, self.union_specs, copies, replicas)


def _send_program(union: Mesh, union_specs: list[PartitionSpec], copies: int, replicas: int):
    """jit(leaves over `union`) -> the same leaves with each replica's group holding its copy's blocks: round j sends
    copy c to replica j * copies + c by one collective-permute along "group". The input is donated."""
    rounds = math.ceil(replicas / copies)

    def send_block(block):
        group = jax.lax.axis_index(GROUP)
        out = block
        for j in range(rounds):
            pairs = [(c, copies + j * copies + c) for c in range(copies) if j * copies + c < replicas]
            received = jax.lax.ppermute(block, GROUP, pairs)
            mine = (group >= copies) & ((group - copies) // copies == j)
            out = jnp.where(mine, received, out)
        return out

    def send(blocks):
        return [send_block(b) for b in blocks]

    return jax.jit(jax.shard_map(send, mesh=union, in_specs=(union_specs,), out_specs=union_specs, check_vma=False),
                   donate_argnums=0)


def _interim_sharding(replica_spec: PartitionSpec, replica: Mesh, shape, source: Mesh) -> NamedSharding | None:
    """`shape` split over every device of `source` along the dim `replica` splits most (None: the replica splits
    no dim, or that dim does not divide by the source's size)."""
    entries = list(replica_spec) + [None] * (len(shape) - len(replica_spec))
    split = [(math.prod(replica.shape[a] for a in _axes(e)), dim) for dim, e in enumerate(entries) if _axes(e)]
    if not split or max(split)[0] == 1:
        return None
    dim = max(split)[1]
    if shape[dim] % source.size:
        return None
    spec = [None] * len(shape)
    spec[dim] = tuple(source.axis_names)
    return NamedSharding(source, PartitionSpec(*spec))


def _source_mesh(params) -> Mesh | None:
    """The one mesh every leaf of `params` is laid out on by a NamedSharding, else None."""
    mesh = mesh_of(params)
    if mesh is None:
        return None
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.devices.tolist() != mesh.devices.tolist():
            return None
    return mesh


def _union_array(staged: jax.Array, placeholder: jax.Array, union: Mesh, spec: PartitionSpec) -> jax.Array:
    """One leaf over the union mesh from its per-device pieces: source copies' shards, then the replicas'."""
    pieces = [s.data for s in staged.addressable_shards] + [s.data for s in placeholder.addressable_shards]
    shape = (staged.shape[0] + placeholder.shape[0], *staged.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(union, spec), pieces,
                                                    dtype=staged.dtype)  # a process may hold none of the pieces


def _replica_array(received: jax.Array, sharding: NamedSharding, mesh: Mesh, shape) -> jax.Array:
    """Replica `mesh`'s part of a sent leaf: its devices' shards, as an array of the replica's layout."""
    devices = set(mesh.devices.flat)
    pieces = [s.data for s in received.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces, dtype=received.dtype)
