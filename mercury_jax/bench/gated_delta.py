"""Benchmark: chunked vs recurrent gated delta rule on CPU as the sequence grows.

Jitted forward of both forms, and forward+backward of the chunked form, at B=1, H=4, K=V=64, chunk 64; fastest wall
time of a few runs after a warm-up (compile) run, and microseconds per token (flat in T when the cost is linear).
Prints a markdown table and writes it to BENCHMARKS.md.

Run: python -m mercury_jax.bench.gated_delta [--repeats 5] [--times 256,512,...]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.bench import jax_setup
from mercury_jax.bench.report import markdown_table, write_section
from mercury_kernels.gated_delta import gated_delta_rule

BATCH, HEADS, KEY_DIM, VALUE_DIM, CHUNK = 1, 4, 64, 64, 64
DEFAULT_TIMES = (1024, 2048, 4096, 8192, 16384)
PIECE = 1024  # the in-pieces column runs T as T / PIECE calls


def make_inputs(time_steps, seed=0):
    """Contract-respecting random inputs: unit q, k (q scaled by K^-0.5), g in [-2, 0], beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, time_steps, HEADS, KEY_DIM))
    k = rng.normal(size=(BATCH, time_steps, HEADS, KEY_DIM))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * KEY_DIM ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(BATCH, time_steps, HEADS, VALUE_DIM))
    g = rng.uniform(-2.0, 0.0, size=(BATCH, time_steps, HEADS))
    beta = rng.uniform(0.0, 1.0, size=(BATCH, time_steps, HEADS))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]


def fastest_seconds(fn, args, repeats):
    """Fastest wall time of `fn(*args)` over `repeats` runs, after one warm-up run that also compiles.

    The fastest run, not the median: the host is shared, and other jobs only ever add time.
    """
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return min(samples)


def in_pieces(fn, inputs, piece):
    """A callable running `fn` on consecutive `piece`-token slices of `inputs`, passing the state along: the same
    work as one call, at the per-token cost of a `piece`-token call. Equal us/token means cost linear in T."""
    slices = [[x[:, start:start + piece] for x in inputs] for start in range(0, inputs[0].shape[1], piece)]

    def run():
        state, outs = None, []
        for args in slices:
            out, state = fn(*args, state)
            outs.append(out)
        return outs, state
    return run


def main():
    jax_setup.configure(platforms="cpu", override_platforms=True)  # no accelerator: the numbers are the host's
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--times", default=",".join(map(str, DEFAULT_TIMES)), help="comma-separated sequence lengths")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = parser.parse_args()

    forward = {impl: jax.jit(lambda q, k, v, g, beta, impl=impl: gated_delta_rule(
        q, k, v, g, beta, impl=impl, chunk_size=CHUNK)) for impl in ("chunked", "recurrent")}
    chunked_with_state = jax.jit(lambda q, k, v, g, beta, state: gated_delta_rule(
        q, k, v, g, beta, initial_state_BxHxKxV=state, impl="chunked", chunk_size=CHUNK))

    def chunked_loss(q, k, v, g, beta):
        out, final = gated_delta_rule(q, k, v, g, beta, impl="chunked", chunk_size=CHUNK)
        return jnp.sum(out) + jnp.sum(final)

    forward_backward = jax.jit(jax.value_and_grad(chunked_loss, argnums=range(5)))

    rows = []
    for time_steps in (int(t) for t in args.times.split(",")):
        inputs = make_inputs(time_steps)
        chunked_s = fastest_seconds(forward["chunked"], inputs, args.repeats)
        pieces_s = fastest_seconds(in_pieces(chunked_with_state, inputs, PIECE), [], args.repeats)
        recurrent_s = fastest_seconds(forward["recurrent"], inputs, args.repeats)
        backward_s = fastest_seconds(forward_backward, inputs, args.repeats)
        tokens = BATCH * time_steps
        rows.append([time_steps, chunked_s * 1e3, chunked_s / tokens * 1e6, pieces_s / tokens * 1e6, recurrent_s * 1e3,
                     recurrent_s / tokens * 1e6, recurrent_s / chunked_s, backward_s * 1e3,
                     backward_s / tokens * 1e6])
        print(f"T={time_steps}: chunked {chunked_s * 1e3:.2f} ms, recurrent {recurrent_s * 1e3:.2f} ms, "
              f"chunked fwd+bwd {backward_s * 1e3:.2f} ms", flush=True)

    headers = ["T", "chunked fwd ms", "chunked fwd us/token", f"chunked fwd in {PIECE}-token calls us/token",
               "recurrent fwd ms", "recurrent fwd us/token",
               "chunked/recurrent (tok/s ratio)", "chunked fwd+bwd ms", "chunked fwd+bwd us/token"]
    table = markdown_table(headers, rows)
    body = (f"B={BATCH}, H={HEADS}, K=V={KEY_DIM}, chunk {CHUNK}, float32, jitted; fastest of {args.repeats} runs "
            f"after a compile/warm-up run (the host is shared; other jobs only add time). fwd+bwd is "
            f"`value_and_grad` w.r.t. q, k, v, g, beta. The chunked form runs in checkpointed blocks of chunks "
            f"(`chunked.chunks_per_block`), so its us/token should not grow with T; the in-{PIECE}-token-calls "
            f"column is the same work done as {PIECE}-token calls passing the state, the linear-cost yardstick "
            f"measured in the same row.\n\n{table}")
    print(table)
    if not args.no_write:
        write_section("gated_delta", "Gated delta rule: chunked vs recurrent (CPU)", body,
                      "python -m mercury_jax.bench.gated_delta")


if __name__ == "__main__":
    main()
