"""Rollout throughput on a tiny model: cached decode vs recomputing the prefix, continuous vs static batching.

    python -m mercury_jax.bench.rollout             # prints the tables, rewrites the "rollout" section of BENCHMARKS.md
    python -m mercury_jax.bench.rollout --no-write

1. Decode: B sequences, greedy, `new` tokens each. "cache" = the sampler's jitted decode steps (prefill excluded);
   "recompute" = a jitted full forward of the whole (fixed-length, right-padded) sequence per step, taking the logits
   at the current position (one compiled shape; cost grows with the padded length, not the prefix). "HF" = Hugging
   Face transformers' greedy `generate` on the same weights and prompts (PyTorch, its reference GDN path), decode
   time = generate(new) - generate(1).
2. Scheduling: requests whose budgets are drawn from [n, 3n] (no stop tokens, so lengths are controlled) through
   the engine with refill (continuous batching) and without (static batches: a batch is admitted only when every
   slot is free). Occupancy = busy slot-steps / all slot-steps of decode. Compilation is excluded (warm-up run).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.rollout import Engine, Request, Sampler
from mercury_jax.rollout.sampler import TokenSampling
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.hf import save_hf


def hf_generate(model, prompts, new: int, repeats: int = 3):
    """HF transformers' greedy `generate` on the same weights (our model -> `save_hf` fp32 -> `from_pretrained`).

    Decode time = generate(new tokens) - generate(1 token), i.e. the prefill and first token are excluded as in the
    sampler row; each is the fastest of `repeats` calls after a warm-up. Returns (seconds for new - 1 decode steps,
    the new - 1 decoded tokens [B, new - 1], torch threads)."""
    import torch  # noqa: PLC0415  (test-only dependency: the HF reference row needs requirements-test.txt)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415  (same)


    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, tmp, dtype=jnp.float32)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long)

    def generate(n):
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out.numpy()

    generate(new), generate(1)  # warm-up
    t_one = min(generate(1)[0] for _ in range(repeats))
    runs = [generate(new) for _ in range(repeats)]
    t_new, out = min(runs, key=lambda r: r[0])
    return t_new - t_one, out[:, prompts.shape[1] + 1:], torch.get_num_threads()


def decode_rates(model, *, batch: int, prompt_len: int, new: int) -> tuple[list[list], int]:
    rng = np.random.RandomState(0)
    prompts = rng.randint(0, model.config.vocab_size, size=(batch, prompt_len))
    max_length = prompt_len + new

    sampler = Sampler(model, num_slots=batch, max_length=max_length)

    def cached():
        state = sampler.init_state()
        for b in range(batch):
            state, _, _ = sampler.prefill(state, b, prompts[b].tolist(), TokenSampling(b, temperature=0.0),
                                          reset=True, limit=new)
        jax.block_until_ready(state)
        start = time.perf_counter()
        state, out, _ = sampler.decode(state, new - 1)
        jax.block_until_ready(out)
        return time.perf_counter() - start, np.asarray(out["token"]).T

    graphdef, params = nnx.split(model)

    @jax.jit
    def recompute_step(params, ids_BxL, t):
        logits_BxLxV = nnx.merge(graphdef, params)(ids_BxL)
        token_B = jnp.argmax(jax.lax.dynamic_index_in_dim(logits_BxLxV, t - 1, axis=1, keepdims=False), axis=-1)
        return ids_BxL.at[:, t].set(token_B.astype(ids_BxL.dtype))

    def recompute():
        ids = jnp.asarray(np.pad(prompts, ((0, 0), (0, new))), jnp.int32)
        ids = recompute_step(params, ids, jnp.int32(prompt_len))  # the first token comes from the "prefill"
        jax.block_until_ready(ids)
        start = time.perf_counter()
        for t in range(prompt_len + 1, max_length):
            ids = recompute_step(params, ids, jnp.int32(t))
        jax.block_until_ready(ids)
        return time.perf_counter() - start, np.asarray(ids)[:, prompt_len + 1:]

    cached(), recompute()  # compile
    t_cache, tokens_cache = min((cached() for _ in range(3)), key=lambda r: r[0])
    t_full, tokens_full = recompute()
    t_hf, tokens_hf, torch_threads = hf_generate(model, prompts, new)
    agree = float(np.mean(tokens_cache == tokens_full))
    steps = new - 1
    return [["cache (sampler decode)", batch, prompt_len, steps, t_cache / steps * 1e3, batch * steps / t_cache, agree,
             1.0],
            ["recompute prefix (full forward)", batch, prompt_len, steps, t_full / steps * 1e3,
             batch * steps / t_full, 1.0, t_full / t_cache],
            ["HF transformers `generate` (greedy, torch)", batch, prompt_len, steps, t_hf / steps * 1e3,
             batch * steps / t_hf, float(np.mean(tokens_hf == tokens_full)), t_hf / t_cache]], torch_threads


def scheduling_rates(model, *, num_requests: int, num_slots: int, min_new: int, prompt_len: int,
                     steps_per_sync: int) -> list[list]:
    rng = np.random.RandomState(1)
    budgets = rng.randint(min_new, 3 * min_new + 1, size=num_requests)
    prompts = rng.randint(0, model.config.vocab_size, size=(num_requests, prompt_len))
    max_length = prompt_len + 3 * min_new
    def run(refill: bool):
        engine = Engine(model, num_slots=num_slots, max_length=max_length, steps_per_sync=steps_per_sync,
                        refill=refill)
        for i in range(num_requests):
            engine.submit(Request(i, prompts[i].tolist(), max_new_tokens=int(budgets[i]), seed=0))
        results = engine.run()
        assert sum(len(r.tokens) for r in results.values()) == int(budgets.sum())
        return engine.stats()

    run(True), run(False)  # compile
    runs = {True: [], False: []}
    for _ in range(3):  # alternate, so both modes see the same load on a shared host
        for refill in (True, False):
            runs[refill].append(run(refill))
    rows = []
    for refill in (True, False):
        stats = min(runs[refill], key=lambda r: r["seconds"])
        rows.append(["continuous (refill)" if refill else "static batches", num_requests, num_slots, steps_per_sync,
                     f"{min_new}-{3 * min_new}", stats["decode_steps"], stats["slot_occupancy"],
                     stats["generated_tokens"], stats["seconds"], stats["tokens_per_second"]])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args()

    cfg = C.tiny(vocab_size=512, num_hidden_layers=4)
    model = Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
    scale = 2 if args.quick else 1
    decode, torch_threads = decode_rates(model, batch=8, prompt_len=32 // scale, new=64 // scale)
    sched = []
    for steps_per_sync in (1, 8):
        sched += scheduling_rates(model, num_requests=64 // scale, num_slots=8, min_new=32 // scale, prompt_len=16,
                                  steps_per_sync=steps_per_sync)

    body = ("Tiny Qwen3.5-MoE (hidden 64, 4 layers: 3 GDN + 1 attention, 8 experts top-2, vocab 512), fp32, CPU.\n\n"
            "Decode (greedy; per step = one new token for every sequence in the batch; 'agree' = fraction of tokens "
            "equal to the recompute path's; 'cache speedup' = this row's decode time / the cached sampler's. "
            "The HF row is "
            "transformers' `generate(do_sample=False, min_new_tokens=max_new_tokens)` on the same weights (`save_hf` "
            f"fp32 -> `AutoModelForCausalLM.from_pretrained`), torch {torch_threads} threads, its reference PyTorch "
            "GDN path; its decode time is generate(new) - generate(1), so prefill is excluded there too):\n\n"
            + markdown_table(["path", "batch", "prompt", "steps", "ms/step", "tokens/s", "agree", "cache speedup"],
                             decode)
            + "\n\nScheduling (temperature 1, no stop tokens, budgets drawn uniformly with a 3x spread; wall time "
              "includes prefills and host syncs, not compilation):\n\n"
            + markdown_table(["engine", "requests", "slots", "steps/sync", "budget", "decode steps", "occupancy",
                              "tokens", "seconds", "tokens/s"], sched))
    print(body)
    if not args.no_write:
        write_section("rollout", "Rollout: cached decode and continuous batching", body,
                      " ".join(["python -m mercury_jax.bench.rollout", *map(shlex.quote, sys.argv[1:])]))


if __name__ == "__main__":
    main()
