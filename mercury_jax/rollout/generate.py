"""`generate`: sample continuations of a list of prompts with the continuous batching engine (the public API)."""
from __future__ import annotations

from flax import nnx

from mercury_jax.rollout.engine import Engine, Request, Sample


def generate(model: nnx.Module, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_token_ids=(), request_ids: list[int] | None = None,
             **engine_options) -> list[Sample]:
    """One `Sample` per prompt, in order: `.tokens`, `.logprobs` (log_softmax of the unscaled logits at each
    sampled token, i.e. the policy at temperature 1), `.sampling_logprobs`, `.finish_reason` ("stop" | "length").

    temperature 0 is greedy. Prompt i is request id `request_ids[i]` (default i), and its draws depend only on
    (seed, request id, token index), never on `num_slots` or the other prompts: pass request ids to reproduce a
    prompt's sample in another call. `engine_options` are the `Engine`'s keywords (`num_slots`, `max_length`,
    `steps_per_sync`, ...): `max_length` caps prompt + generated tokens per sequence (default: longest prompt +
    max_new_tokens); `num_slots` defaults to min(len(prompts), 8).
    """
    if not prompts:
        return []
    if engine_options.get("max_length") is None:
        engine_options["max_length"] = max(len(p) for p in prompts) + max_new_tokens
    if engine_options.get("num_slots") is None:
        engine_options["num_slots"] = min(len(prompts), 8)
    engine = Engine(model, **engine_options)
    if request_ids is None:
        request_ids = list(range(len(prompts)))
    if len(request_ids) != len(prompts):
        raise ValueError(f"{len(request_ids)} request ids for {len(prompts)} prompts; give one per prompt")
    for rid, prompt in zip(request_ids, prompts):
        engine.submit(Request(request_id=rid, prompt=list(prompt), max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                              stop_token_ids=tuple(stop_token_ids)))
    results = engine.run()
    return [results[rid] for rid in request_ids]
