"""Our jitted Flax Qwen3.5-MoE against Hugging Face transformers' PyTorch model on this CPU: forward and
forward+backward (next-token cross-entropy) tokens/s at a few (B, T), with identical weights; prints a table and
writes the `model` section of BENCHMARKS.md.

Both models are built from one small config: HF's `Qwen3_5MoeForCausalLM` is initialised at random (norm weights
perturbed so a wrong norm would show), saved with `save_pretrained`, and loaded into ours with `load_hf`. Logits
(and the loss) are checked to agree before any timing is reported. Repetitions alternate JAX and torch so load from
other work on the machine hits both alike; each number is the median of `--repeats` timed calls after warm-up.

HF runs its reference PyTorch Gated DeltaNet path unless `fla` / `causal_conv1d` are installed (the table title
says which); that is HF's reference implementation, not its fastest.

Run: `python -m mercury_jax.bench.model [--shapes 1x128,2x256 --repeats 3 --torch-threads 2]`
"""
from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from mercury_jax.bench import jax_setup
from mercury_jax.bench.report import markdown_table, write_section
from models.qwen35_moe import config as C
from models.qwen35_moe.hf import load_hf

LOGIT_ATOL = 1e-4
CONFIG = dict(vocab_size=4096, num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
              linear_num_value_heads=8, moe_intermediate_size=128, shared_expert_intermediate_size=256,
              num_experts=16, num_experts_per_tok=4)


def hf_reference_model(cfg: C.Qwen35MoeConfig, seed: int = 0):
    """A random HF Qwen3_5MoeForCausalLM (fp32, eval), as `tests/hf_reference.py` builds it."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: PLC0415  (test-only dependency)

    fields = {k: v for k, v in cfg.to_hf_text().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def jax_next_token_loss(model, ids_BxT):
    logp_BxTxV = jax.nn.log_softmax(model(ids_BxT)[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp_BxTxV, ids_BxT[:, 1:, None], axis=-1))


def torch_next_token_loss(model, ids_BxT):
    logits_BxTxV = model(ids_BxT).logits
    return torch.nn.functional.cross_entropy(logits_BxTxV[:, :-1].reshape(-1, logits_BxTxV.shape[-1]),
                                             ids_BxT[:, 1:].reshape(-1))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_shape(ours, hf, batch, steps, vocab, repeats, seed):
    """One (B, T): parity check, then interleaved JAX / torch timings of forward and forward+backward."""
    ids_np = np.random.default_rng(seed).integers(0, vocab, size=(batch, steps), dtype=np.int32)
    ids_jax, ids_torch = jnp.asarray(ids_np), torch.as_tensor(ids_np, dtype=torch.long)

    forward = nnx.jit(lambda m, ids: m(ids))
    train_step = nnx.jit(lambda m, ids: nnx.value_and_grad(jax_next_token_loss)(m, ids))

    def jax_forward():
        return jax.block_until_ready(forward(ours, ids_jax))

    def jax_train():
        return jax.block_until_ready(train_step(ours, ids_jax))

    def torch_forward():
        with torch.no_grad():
            return hf(ids_torch).logits

    def torch_train():
        hf.zero_grad(set_to_none=True)
        loss = torch_next_token_loss(hf, ids_torch)
        loss.backward()
        return loss

    # first calls: JAX traces + compiles + runs once; both double as warm-up and as the parity check
    fwd_first_s, jax_logits = timed(jax_forward)
    _, hf_logits = timed(torch_forward)
    logit_err = float(np.max(np.abs(np.asarray(jax_logits) - hf_logits.numpy())))
    if not logit_err < LOGIT_ATOL:
        raise AssertionError(f"B={batch} T={steps}: max |logits JAX - HF| = {logit_err:.3g} >= {LOGIT_ATOL}")
    train_first_s, (jax_loss, _) = timed(jax_train)
    hf_loss = torch_train().item()
    loss_err = abs(float(jax_loss) - hf_loss)
    if not loss_err < LOGIT_ATOL:
        raise AssertionError(f"B={batch} T={steps}: |loss JAX - HF| = {loss_err:.3g} >= {LOGIT_ATOL}")
    del jax_logits, hf_logits

    times = {k: [] for k in ("jax_fwd", "hf_fwd", "jax_train", "hf_train")}
    for _ in range(repeats):
        times["jax_fwd"].append(timed(jax_forward)[0])
        times["hf_fwd"].append(timed(torch_forward)[0])
        times["jax_train"].append(timed(jax_train)[0])
        times["hf_train"].append(timed(torch_train)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = batch * steps
    return dict(
        shape=f"{batch} x {steps}",
        jax_fwd=tokens / med["jax_fwd"], hf_fwd=tokens / med["hf_fwd"],
        fwd_ratio=med["hf_fwd"] / med["jax_fwd"],
        jax_train=tokens / med["jax_train"], hf_train=tokens / med["hf_train"],
        train_ratio=med["hf_train"] / med["jax_train"],
        fwd_compile=fwd_first_s - med["jax_fwd"], train_compile=train_first_s - med["jax_train"],
        logit_err=logit_err, loss_err=loss_err,
    )


def main():
    jax_setup.configure(platforms="cpu", override_platforms=True)  # the numbers are this host's
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x128,2x256", help="comma-separated BxT")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    torch.set_num_threads(args.torch_threads)

    cfg = C.tiny(**CONFIG)
    hf = hf_reference_model(cfg)
    n_params = sum(p.numel() for p in hf.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_hf(tmp)

    rows, results = [], []
    for i, (batch, steps) in enumerate(shapes):
        r = bench_shape(ours, hf, batch, steps, cfg.vocab_size, args.repeats, seed=i)
        results.append(r)
        print(f"{r['shape']}: fwd JAX {r['jax_fwd']:.0f} tok/s, HF {r['hf_fwd']:.0f} tok/s; fwd+bwd JAX "
              f"{r['jax_train']:.0f} tok/s, HF {r['hf_train']:.0f} tok/s", flush=True)
        rows.append([r["shape"], r["jax_fwd"], r["hf_fwd"], r["fwd_ratio"], r["jax_train"], r["hf_train"],
                     r["train_ratio"], r["fwd_compile"], r["train_compile"], r["logit_err"], r["loss_err"]])
    headers = ["B x T", "JAX fwd tok/s", "HF fwd tok/s", "fwd JAX/HF", "JAX fwd+bwd tok/s", "HF fwd+bwd tok/s",
               "fwd+bwd JAX/HF", "JAX fwd compile (s)", "JAX fwd+bwd compile (s)", "max |dlogits|", "|dloss|"]
    table = markdown_table(headers, rows)

    fast_kernels = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
    hf_path = ("reference PyTorch GDN path (no fla / causal_conv1d kernels installed)" if not fast_kernels
               else f"with {', '.join(fast_kernels)} installed")
    title = f"Qwen3.5-MoE model on CPU: jitted JAX vs HF transformers ({hf_path})"
    attn = getattr(hf.config, "_attn_implementation", "?")
    experts = getattr(hf.config, "_experts_implementation", None)
    layers = ", ".join("GDN" if t == C.LINEAR_ATTENTION else "attn" for t in cfg.layer_types)
    body = (
        f"{table}\n\n"
        f"Config: `tiny` with hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({layers}), vocab "
        f"{cfg.vocab_size}, attention {cfg.num_attention_heads}q/{cfg.num_key_value_heads}kv x {cfg.head_dim}, GDN "
        f"{cfg.linear_num_key_heads}k/{cfg.linear_num_value_heads}v heads x "
        f"{cfg.linear_key_head_dim}/{cfg.linear_value_head_dim}, {cfg.num_experts} experts top-"
        f"{cfg.num_experts_per_tok} (intermediate {cfg.moe_intermediate_size}, shared "
        f"{cfg.shared_expert_intermediate_size}); {n_params / 1e6:.1f}M parameters, fp32 everywhere. Same weights "
        f"(HF `save_pretrained` -> our `load_hf`); the logits and loss columns are the JAX-HF differences of the "
        f"first call at each shape, asserted < {LOGIT_ATOL:g}.\n\n"
        f"Forward: `nnx.jit(lambda m, ids: m(ids))` vs HF under `torch.no_grad()` in eval mode, both returning "
        f"[B, T, V] fp32 logits. Forward+backward: jitted `nnx.value_and_grad` of the mean next-token "
        f"cross-entropy vs the same loss in torch + `loss.backward()` (grads set to None before each step). "
        f"Ratios above 1 mean JAX is faster (HF time / JAX time). Median of {args.repeats} timed calls after "
        f"one warm-up call each, JAX and torch alternating; `jax.block_until_ready` on every JAX result. "
        f"Compile columns are the first jitted call minus the median steady call (tracing + XLA compilation). "
        f"torch {torch.__version__} with {args.torch_threads} threads, transformers attention `{attn}`"
        + (f", experts `{experts}`" if experts else "") + "; XLA uses its default CPU threading."
    )
    print(f"\n## {title}\n\n{body}")
    if not args.no_write:
        command = " ".join(["python -m mercury_jax.bench.model", *map(shlex.quote, sys.argv[1:])])
        write_section("model", title, body, command)


if __name__ == "__main__":
    main()
