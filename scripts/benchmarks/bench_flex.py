"""Bias schemes on CUDA: flex_attention against the dense bias, forward + backward time and peak memory.

A LLaMA-shaped model (2 layers, 16 heads of 128, 8 kv heads, bf16 weights) swapped to each scheme runs one
prefill of ``--length`` tokens with a loss and its backward, on the flex path and on the dense path
(``FLEX_DEVICES`` emptied); a scheme named ``NAME/1`` runs with ``FLEX_LANES = 1`` (every gradient add of a
head's parameter at one address) to show what the lanes save. Prints one line per scheme: milliseconds (median
of ``--repeats`` after a warm-up that includes compiling), peak GiB, and the largest difference of the logits
and of the position parameters' gradients from the dense path's. CUDA only::

    python scripts/benchmarks/bench_flex.py --length 8192 --schemes kerple fire
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posswap as ps
from hf_posswap.core import flex_bias
from hf_posswap.core.paths import record_paths

SCHEMES = {
    "alibi": lambda: ps.AlibiConfig(trainable_slopes=True),
    "t5": lambda: ps.T5BiasConfig(),
    "kerple": lambda: ps.KerpleConfig(),
    "sandwich": lambda: ps.SandwichConfig(),
    "fire": lambda: ps.FireConfig(),
}


def build(scheme: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=8, intermediate_size=4096, max_position_embeddings=1 << 17)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    ps.swap(model, SCHEMES[scheme]())
    positions = model.base_model.posswap_positions
    with torch.no_grad():
        for parameter in positions.parameters():  # random values: zero tables would hide a wrong gradient
            parameter.copy_(0.1 * torch.randn_like(parameter))
    positions.float()
    return model.train()


def step(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict, list]:
    model.zero_grad(set_to_none=True)
    with record_paths() as paths:
        logits = model(input_ids=input_ids).logits
    logits.float().square().mean().backward()
    grads = {name: p.grad.float().clone() for name, p in model.base_model.posswap_positions.named_parameters()
             if p.grad is not None}
    return logits.detach().float(), grads, sorted(set(paths))


def measure(model: torch.nn.Module, input_ids: torch.Tensor, repeats: int) -> tuple[float, float, tuple]:
    result = step(model, input_ids)  # warm-up (compiles on the flex path)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(model, input_ids)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schemes", nargs="+", default=["kerple", "fire"],
                        choices=[*SCHEMES, *(f"{name}/1" for name in SCHEMES)])
    args = parser.parse_args()
    input_ids = torch.randint(0, 1024, (1, args.length), device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.length} tokens, fwd+bwd")
    lanes = flex_bias.FLEX_LANES
    for scheme in args.schemes:
        model = build(scheme.split("/")[0])
        flex_bias.FLEX_LANES = 1 if scheme.endswith("/1") else lanes
        start = time.perf_counter()
        flex_ms, flex_gib, (flex_logits, flex_grads, flex_paths) = measure(model, input_ids, args.repeats)
        compile_s = time.perf_counter() - start
        flex_bias.FLEX_DEVICES.discard("cuda")
        try:
            dense_ms, dense_gib, (logits, grads, dense_paths) = measure(model, input_ids, args.repeats)
        finally:
            flex_bias.FLEX_DEVICES.add("cuda")
            flex_bias.FLEX_LANES = lanes
        logit_error = float((flex_logits - logits).abs().max())
        scale = max(float(g.abs().max()) for g in grads.values()) + 1e-12  # one scale: some gradients are ~0
        grad_error = max(float((flex_grads[n] - g).abs().max()) / scale for n, g in grads.items())
        print(f"{scheme:10s} flex {flex_paths} {flex_ms:8.1f} ms {flex_gib:6.2f} GiB (first run with compile "
              f"{compile_s:.0f} s) | dense {dense_paths} {dense_ms:8.1f} ms {dense_gib:6.2f} GiB | max |logit diff| "
              f"{logit_error:.3g}, max relative grad diff {grad_error:.3g}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
