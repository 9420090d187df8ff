"""bench/hlo_bytes.py on a hand-written optimised HLO module, counted by hand: a loop of 4 trips whose body slices a
layer out of a stacked weight inside a fusion (the slice counts, not the stack), updates a stacked buffer in place
(the update counts, not the buffer), runs a Pallas call (its declared bytes) and a copy into on-chip memory (S(1):
the HBM side only); outside the loop a whole-buffer copy, which `entry_transfers` lists."""
# ruff: noqa: E501 (an HLO instruction is one long line)
from __future__ import annotations

from mercury_jax.bench.hlo_bytes import entry_transfers, module_bytes

MODULE = """HloModule example

%slice_weight (p0: f32[4,256,256], p1: s32[]) -> f32[256,256] {
  %p0 = f32[4,256,256]{2,1,0} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %c0 = s32[] constant(0)
  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,256,256}
  ROOT %b = f32[256,256]{1,0} bitcast(%ds)
}

%update_stack (q0: f32[4,1024], q1: s32[], q2: f32[1,1024]) -> f32[4,1024] {
  %q0 = f32[4,1024]{1,0} parameter(0)
  %q2 = f32[1,1024]{1,0} parameter(2)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,1024]{1,0} dynamic-update-slice(%q0, %q2, %q1, %z)
}

%body (state: (s32[], f32[4,256,256], f32[4,1024])) -> (s32[], f32[4,256,256], f32[4,1024]) {
  %state = (s32[], f32[4,256,256]{2,1,0}, f32[4,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %w = f32[4,256,256]{2,1,0} get-tuple-element(%state), index=1
  %buf = f32[4,1024]{1,0} get-tuple-element(%state), index=2
  %layer = f32[256,256]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_weight
  %kernel = f32[1,1024]{1,0} custom-call(%layer), custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"bytes_accessed":"300000","flops":"1"}}
  %onchip = (f32[1,1024]{1,0:S(1)}, f32[1,1024]{1,0}, u32[]{:S(2)}) copy-start(%kernel)
  %new = f32[4,1024]{1,0} fusion(%buf, %i, %kernel), kind=kLoop, calls=%update_stack
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4,256,256]{2,1,0}, f32[4,1024]{1,0}) tuple(%next, %w, %new)
}

%cond (state.1: (s32[], f32[4,256,256], f32[4,1024])) -> pred[] {
  %state.1 = (s32[], f32[4,256,256]{2,1,0}, f32[4,1024]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  %trips = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %trips), direction=LT
}

ENTRY %main (weights: f32[4,256,256], buffer: f32[4,1024]) -> f32[4,1024] {
  %weights = f32[4,256,256]{2,1,0} parameter(0)
  %buffer = f32[4,1024]{1,0} parameter(1)
  %copied = f32[4,1024]{1,0} copy(%buffer)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,256,256]{2,1,0}, f32[4,1024]{1,0}) tuple(%zero, %weights, %copied)
  %loop = (s32[], f32[4,256,256]{2,1,0}, f32[4,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %result = f32[4,1024]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_bytes_by_hand():
    layer = 256 * 256 * 4          # the slice fusion: writes one layer, reads one layer of the stack
    row = 1024 * 4                  # one stacked row
    body = (
        2 * layer + 4               # %layer (and the layer index it reads)
        + 300_000                   # %kernel: its declared bytes
        + row + row                 # %onchip: reads the kernel's output, writes the HBM side (S(1) is on chip)
        + row + 4 + row             # %new: writes the update in place, reads the index and the update
        + 4 + 4 + 4                 # %next: an unfused add of two scalars
    )
    cond = 4 + 4 + 1                # %lt: compare of two scalars
    entry = 2 * 4 * row             # %copied: reads and writes the buffer
    assert module_bytes(MODULE) == entry + 4 * (body + cond)
    assert entry_transfers(MODULE, 1024) == [("copied", "copy", 4 * row)]


def test_collectives_are_counted_per_chip_with_their_loops_trip_counts():
    """A CPU-compiled shard_map over 4 devices: an all-gather of 256 floats a chip (4 KiB received) in a loop of 3
    trips, and one collective-permute of 256 floats (1 KiB) outside it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from mercury_jax.bench.hlo_bytes import collective_bytes

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def local(a):
        def body(i, acc):
            return acc + jnp.sum(jax.lax.all_gather(acc * (i + 1), "x", tiled=True).reshape(4, -1), axis=0)
        a = jax.lax.fori_loop(0, 3, body, a)
        return jax.lax.ppermute(a, "x", [(k, (k + 1) % 4) for k in range(4)])

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    text = fn.lower(jnp.ones((4 * 256,), jnp.float32)).compile().as_text()
    counted = collective_bytes(text)
    assert counted.get("all-gather") == 3 * 4 * 256 * 4, counted
    assert counted.get("collective-permute") == 256 * 4, counted


# the publish's programs compile to flat (loop-free) HLO: a synchronous all-gather, an async collective-permute pair
# whose -start carries (operand, result, u32[] contexts), a ragged all-to-all, and a reduce (no collective)
FLAT = """ENTRY %main (p: bf16[8,128]) -> bf16[32,128] {
  %p = bf16[8,128]{1,0} parameter(0)
  %ag = bf16[32,128]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  %cp-start = (bf16[32,128]{1,0}, bf16[32,128]{1,0}, u32[], u32[]) collective-permute-start(%ag), source_target_pairs={{0,1}}
  %cp-done = bf16[32,128]{1,0} collective-permute-done(%cp-start)
  %ra = f32[16]{0} ragged-all-to-all(%p, %p, %p, %p, %p, %p)
  %ar = f32[4,4]{1,0} all-reduce-start(%ra), to_apply=%add
  ROOT %out = bf16[32,128]{1,0} add(%cp-done, %cp-done)
}
"""


def test_collective_results_count_each_op_once_by_its_results():
    from mercury_jax.bench.hlo_bytes import collective_results

    assert collective_results(FLAT) == {
        "all-gather": (1, 32 * 128 * 2),          # its result, per device
        "collective-permute": (1, 32 * 128 * 2),  # the -start's results half (not its operand), the -done not again
        "ragged-all-to-all": (1, 16 * 4),
        "all-reduce": (1, 4 * 4 * 4),
    }


def test_collective_ops_count_the_ops_but_not_the_permutes():
    from mercury_jax.bench.hlo_bytes import collective_ops

    assert collective_ops(FLAT) == {"all-gather": 1, "ragged-all-to-all": 1, "all-reduce": 1}
