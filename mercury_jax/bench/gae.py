"""Skip-observation GAE at the SAO batch shape [128, 24576] on this CPU: the reverse `lax.scan` (several unroll
factors) against an associative-scan formulation and a NumPy loop over time; prints a table and writes the `gae`
section of BENCHMARKS.md.

Run: `python -m mercury_jax.bench.gae [--batch 128 --steps 24576 --repeats 5]`
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.bench import jax_setup
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.rl import advantages as adv_lib


def associative_scan_gae(rewards_BxT, values_BxT, mask_BxT, gamma, lam):
    """The same skip-observation GAE without a sequential loop: gather each token's next action value, fold
    masked rewards onto the preceding action, then solve A_t = c_t A_{t+1} + delta_t with an associative scan
    (c_t = gamma * lam on action tokens, 1 on masked ones, which carries A through them)."""
    batch, steps = rewards_BxT.shape
    time_T = jnp.arange(steps)
    action_idx_BxT = jnp.where(mask_BxT, time_T, steps)
    at_or_after_BxT = jax.lax.cummin(action_idx_BxT, axis=1, reverse=True)
    next_idx_BxT = jnp.concatenate([at_or_after_BxT[:, 1:], jnp.full((batch, 1), steps)], axis=1)
    values_pad_BxT1 = jnp.concatenate([values_BxT, jnp.zeros((batch, 1))], axis=1)  # V_{L+1} = 0
    next_value_BxT = jnp.take_along_axis(values_pad_BxT1, next_idx_BxT, axis=1)
    masked_cum_BxT1 = jnp.concatenate(
        [jnp.zeros((batch, 1)), jnp.cumsum(jnp.where(mask_BxT, 0.0, rewards_BxT), axis=1)], axis=1)
    folded_BxT = (jnp.take_along_axis(masked_cum_BxT1, next_idx_BxT, axis=1)
                  - jnp.take_along_axis(masked_cum_BxT1, time_T[None] + 1, axis=1))
    delta_BxT = jnp.where(mask_BxT, rewards_BxT + folded_BxT + gamma * next_value_BxT - values_BxT, 0.0)
    coef_BxT = jnp.where(mask_BxT, gamma * lam, 1.0)

    def compose(later, earlier):  # in reversed time: `later` is applied first
        c1, d1 = later
        c2, d2 = earlier
        return c1 * c2, c2 * d1 + d2

    _, adv_rev_BxT = jax.lax.associative_scan(compose, (coef_BxT[:, ::-1], delta_BxT[:, ::-1]), axis=1)
    adv_BxT = jnp.where(mask_BxT, adv_rev_BxT[:, ::-1], 0.0)
    return adv_BxT, jnp.where(mask_BxT, adv_BxT + values_BxT, 0.0)


def numpy_loop_gae(rewards_BxT, values_BxT, mask_BxT, gamma, lam):
    """Reference: a Python loop over time, vectorised over the batch, in float64."""
    batch, steps = rewards_BxT.shape
    next_value, next_adv, pending = np.zeros(batch), np.zeros(batch), np.zeros(batch)
    adv = np.zeros((batch, steps))
    for t in range(steps - 1, -1, -1):
        is_action = mask_BxT[:, t]
        reward = rewards_BxT[:, t] + pending
        a = reward + gamma * next_value - values_BxT[:, t] + gamma * lam * next_adv
        adv[:, t] = np.where(is_action, a, 0.0)
        next_value = np.where(is_action, values_BxT[:, t], next_value)
        next_adv = np.where(is_action, a, next_adv)
        pending = np.where(is_action, 0.0, reward)
    return adv, np.where(mask_BxT, adv + values_BxT, 0.0)


def sao_like_batch(batch, steps, seed=0):
    """Rows of different lengths with assistant turns and observation gaps; reward on the last action token."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, steps), bool)
    for b in range(batch):
        length = int(rng.integers(steps // 4, steps + 1))
        t = int(rng.integers(200, 2000))
        while t < length:
            turn = int(rng.integers(50, 800))
            mask[b, t:min(t + turn, length)] = True
            t += turn + int(rng.integers(20, 1500))  # observation
    values = rng.normal(size=(batch, steps)).astype(np.float32)
    rewards = np.asarray(adv_lib.place_terminal_reward(rng.random(batch), mask))
    return rewards, values, mask


def time_it(fn, repeats):
    """(median seconds over `repeats` calls, last output); the first call (compilation) is not counted."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def main():
    jax_setup.configure(platforms="cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24576)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    gamma, lam = 1.0, 0.95
    rewards, values, mask = sao_like_batch(args.batch, args.steps)
    r, v, m = jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask)
    lam_B = jnp.full((args.batch,), lam)
    zeros_B, gamma_B = jnp.zeros((args.batch,)), jnp.full((args.batch,), gamma)
    tokens = args.batch * args.steps

    candidates = [(f"lax.scan, unroll {u}" + (" (default)" if u == 8 else ""),
                   lambda u=u: adv_lib._gae_scan(r, v, m, gamma_B, lam_B, zeros_B, unroll=u)) for u in (1, 8, 32)]
    assoc = jax.jit(associative_scan_gae)
    candidates.append(("jnp associative_scan", lambda: assoc(r, v, m, gamma, lam)))
    candidates.append(("NumPy loop over T (float64)", lambda: numpy_loop_gae(rewards.astype(np.float64),
                                                                             values.astype(np.float64),
                                                                             mask, gamma, lam)))
    results = []
    for name, fn in candidates:
        seconds, (adv, _) = time_it(fn, args.repeats if "NumPy" not in name else 1)
        results.append((name, seconds, np.asarray(adv)))
        print(f"{name}: {seconds * 1e3:.1f} ms", flush=True)
    reference = results[-1][2]
    base = results[1][1]
    rows = [[name, f"[{args.batch}, {args.steps}]", seconds * 1e3, tokens / seconds / 1e6, seconds / base,
             float(np.max(np.abs(adv - reference)))] for name, seconds, adv in results]
    headers = ["implementation", "shape", "time (ms)", "Mtokens/s", "time / default", "max |A - NumPy|"]
    table = markdown_table(headers, rows)
    body = (f"{table}\n\nAction tokens: {mask.mean():.1%} of positions; gamma {gamma}, lambda {lam}; median of "
            f"{args.repeats} jitted calls after compilation (NumPy: one call). float32 except the NumPy reference. "
            "The default `skip_observation_gae` is the lax.scan with unroll 8.")
    print(table)
    if not args.no_write:
        command = "python -m mercury_jax.bench.gae" + (
            f" --batch {args.batch} --steps {args.steps}" if (args.batch, args.steps) != (128, 24576) else "")
        write_section("gae", "Skip-observation GAE on CPU", body, command)


if __name__ == "__main__":
    main()
