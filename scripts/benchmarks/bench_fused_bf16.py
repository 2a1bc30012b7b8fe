"""Half-precision fused ALiBi / T5 attention on CPU against the dense path and native sdpa: error and speed.

One attention call, 8 heads of 64 (causal: 2 key-value heads, as LLaMA's grouped queries; bidirectional: 8), batch
1, bfloat16 q/k/v. Three ways to the same output:

- fused: the scheme's ``fused_attention`` (what the sdpa carrier runs);
- dense: the scheme's ``[1, H, q, kv]`` bias merged into a bfloat16 mask as ``scheme_inputs`` does, then
  transformers' ``sdpa_attention_forward`` (the mask is built before timing: a model builds it once per forward and
  every layer shares it, so this favours the dense path);
- native: sdpa with no bias at all (``is_causal`` / no mask), the cost floor.

Error: max and root-mean-square |output - reference| over the first, middle and last 128 queries, where the
reference is float64 attention with the exact bias on the same bfloat16 inputs (so it measures the attention's
arithmetic, not the inputs' rounding); ``floor`` is the reference itself rounded to bfloat16. ``build``: the time
the dense path takes to build its mask, once per forward. Speed: rounds of the three in ABBA order
(``--threads``, default 2), medians and the ratio of medians. Run::

    PYTHONPATH=. python scripts/benchmarks/bench_fused_bf16.py --lengths 2048 8192 --rounds 4
    PYTHONPATH=. python scripts/benchmarks/bench_fused_bf16.py --lengths 2048 --train   # forward + backward
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from hf_posswap.core.attention import merge_bias_and_mask
from hf_posswap.schemes.alibi import AlibiBias, alibi_slopes
from hf_posswap.schemes.base import BiasPositions, FusedCall
from hf_posswap.schemes.t5 import T5RelativeBias
from hf_posswap.transformers_internals import sdpa_attention

HEADS, HEAD_DIM = 8, 64


def scheme(name: str) -> BiasPositions:
    if name == "alibi":
        return AlibiBias(alibi_slopes(HEADS), trainable=False)
    module = T5RelativeBias(HEADS, 1, 32, 128, True)  # T5's buckets; a table with a trained model's spread
    nn.init.normal_(module.tables[0].weight, std=2.0, generator=torch.Generator().manual_seed(1))
    return module


def make_call(length: int, causal: bool, dtype: torch.dtype) -> FusedCall:
    generator = torch.Generator().manual_seed(0)
    kv_heads = 2 if causal else HEADS

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, length, HEAD_DIM, generator=generator).to(dtype)

    positions = torch.arange(length)
    return FusedCall(randn(HEADS), randn(kv_heads), randn(kv_heads), None, positions, positions, 0, causal,
                     HEAD_DIM**-0.5, 0.0, {}, (0, 0))


class Stub(nn.Module):
    """What ``sdpa_attention_forward`` reads from an attention layer."""

    def __init__(self, groups: int, causal: bool) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, causal


def dense_runner(bias: BiasPositions, call: FusedCall) -> Callable[[], torch.Tensor]:
    """The dense path with its mask prebuilt: output [B, q, H, D]."""
    full = bias(call.query_pos, call.key_pos, 0, call.causal, {})
    allowed = call.key_pos[None, :] <= call.query_pos[:, None] if call.causal else None
    mask = merge_bias_and_mask(full, None, allowed, call.query.dtype)
    del full
    stub = Stub(call.query.shape[1] // call.key.shape[1], call.causal)
    return lambda: sdpa_attention()(stub, call.query, call.key, call.value, mask, scaling=call.scaling)[0]


def native(call: FusedCall) -> torch.Tensor:
    output = F.scaled_dot_product_attention(call.query, call.key, call.value, is_causal=call.causal,
                                            scale=call.scaling, enable_gqa=True)
    return output.transpose(1, 2)


def sample_rows(length: int) -> torch.Tensor:
    return torch.cat([torch.arange(128), torch.arange(length // 2 - 64, length // 2 + 64), torch.arange(length - 128,
                                                                                                       length)])


def reference(bias: BiasPositions, call: FusedCall, rows: torch.Tensor) -> torch.Tensor:
    """float64 attention of queries ``rows`` on the call's own (rounded) inputs: [B, rows, H, D]."""
    groups = call.query.shape[1] // call.key.shape[1]
    query = call.query[:, :, rows].double()
    key, value = (t.double().repeat_interleave(groups, 1) for t in (call.key, call.value))
    exact = bias(rows, call.key_pos, 0, call.causal, None).double()  # [1, H, rows, kv]
    if call.causal:
        exact = exact.masked_fill(call.key_pos[None, :] > rows[:, None], float("-inf"))
    weights = torch.softmax(query @ key.transpose(-1, -2) * call.scaling + exact, dim=-1)
    return (weights @ value).transpose(1, 2)


def error(got: torch.Tensor, want: torch.Tensor) -> str:
    difference = got - want
    return f"{difference.abs().max().item():.2e} / {difference.square().mean().sqrt().item():.2e}"


def abba(runners: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    """Median seconds of each runner over ``rounds`` rounds, the order reversed every other round."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(name: str, causal: bool, length: int, rounds: int, dtype: torch.dtype) -> None:
    bias, call = scheme(name), make_call(length, causal, dtype)
    rows = sample_rows(length)
    with torch.no_grad():
        start = time.perf_counter()
        dense = dense_runner(bias, call)
        build = time.perf_counter() - start
        runners = {"fused": lambda: bias.fused_attention(call), "dense": dense, "native": lambda: native(call)}
        want = reference(bias, call, rows)
        errors = {key: error(runners[key]()[:, rows].double(), want) for key in ("fused", "dense")}
        floor = error(want.to(dtype).double(), want)
        runners["fused"]()  # warm
        seconds = abba(runners, rounds)
    kind = "causal" if causal else "bidirectional"
    times = " ".join(f"{key} {1e3 * value:.1f}" for key, value in seconds.items())
    print(f"{name:5} {kind:13} {length:5} {str(dtype)[6:]:8}  max / rms error: fused {errors['fused']} dense "
          f"{errors['dense']} floor {floor}  ms: {times} (build {1e3 * build:.1f})  fused/dense "
          f"{seconds['fused'] / seconds['dense']:.2f} fused/native {seconds['fused'] / seconds['native']:.2f}",
          flush=True)


def measure_training(name: str, causal: bool, length: int, rounds: int, dtype: torch.dtype) -> None:
    """Forward and backward: q, k, v train; T5's table trains too (the dense path then builds its bias with a
    gradient in every forward, and sdpa runs its math fallback), ALiBi's slopes are fixed (as the paper has them)."""
    bias, call = scheme(name), make_call(length, causal, dtype)
    bias.requires_grad_(name == "t5")
    for tensor in (call.query, call.key, call.value):
        tensor.requires_grad_()
    grad = torch.randn(1, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    dense = None if name == "t5" else dense_runner(bias, call)  # a fixed bias: built once, outside the timing

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: forward().backward(grad)

    runners = {
        "fused": step(lambda: bias.fused_attention(call)),
        "dense": step(dense if dense is not None else lambda: dense_runner(bias, call)()),
        "native": step(lambda: native(call)),
    }
    runners["fused"]()  # warm
    seconds = abba(runners, rounds)
    kind = "causal" if causal else "bidirectional"
    times = " ".join(f"{key} {1e3 * value:.1f}" for key, value in seconds.items())
    print(f"{name:5} {kind:13} {length:5} {str(dtype)[6:]:8}  forward+backward ms: {times}  fused/dense "
          f"{seconds['fused'] / seconds['dense']:.2f} fused/native {seconds['fused'] / seconds['native']:.2f}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--schemes", nargs="+", default=["alibi", "t5"], choices=["alibi", "t5"])
    parser.add_argument("--modes", nargs="+", default=["causal", "bidirectional"], choices=["causal", "bidirectional"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--train", action="store_true", help="time forward + backward instead (no error columns)")
    settings = parser.parse_args()
    torch.set_num_threads(settings.threads)
    for length in settings.lengths:
        for name in settings.schemes:
            for mode in settings.modes:
                run = measure_training if settings.train else measure
                run(name, mode == "causal", length, settings.rounds, getattr(torch, settings.dtype))


if __name__ == "__main__":
    main()
