"""Half-precision fused ALiBi and T5 attention on CPU (bfloat16 / float16 models, and float32 models under CPU
autocast): the fused forms take these calls, are at least as exact as the dense path, and train the same.

Every error is measured against float64 attention on the *same* rounded inputs, so it is the attention's own
arithmetic. bfloat16 keeps 8 significant bits: rounding one number costs up to 2**-9 of it (2e-3), and the output
is rounded once at the end (its ``floor``). The dense path also rounds its bias to the model's dtype; the fused forms
keep bias numbers in float32 (module docstrings of ``fused_alibi`` / ``fused_t5``). Tolerances below come from
measurements on these shapes (noted beside each), with room left for other CPUs' rounding.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import VOCAB, make_model
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hf_posswap as ps
from hf_posswap.core.attention import autocast_inputs, merge_bias_and_mask
from hf_posswap.core.paths import DENSE, FUSED_ALIBI, FUSED_T5, record_paths
from hf_posswap.schemes.alibi import AlibiBias, alibi_slopes
from hf_posswap.schemes.base import BiasPositions, FusedCall
from hf_posswap.schemes.t5 import T5RelativeBias

HALF = [torch.bfloat16, torch.float16]
LENGTH, HEADS, DIM = 300, 8, 64
PATHS = {"alibi": FUSED_ALIBI, "t5": FUSED_T5}


# --- one attention call: fused and dense against float64 ----------------------------------------------------------


def scheme(name: str, heads: int, trainable: bool) -> BiasPositions:
    """ALiBi with slopes off the powers of two (so their half-precision rounding shows), or T5 with T5's 32 buckets /
    128 and a table of a trained model's spread; ``trainable``: the slopes / table require a gradient."""
    if name == "alibi":
        module = AlibiBias(alibi_slopes(heads) * 1.37, trainable=True)
    else:
        module = T5RelativeBias(heads, 1, 32, 128, True)
        nn.init.normal_(module.tables[0].weight, std=2.0, generator=torch.Generator().manual_seed(1))
    return module.requires_grad_(trainable)


def make_call(length: int, causal: bool, dtype: torch.dtype, heads: int = HEADS, dim: int = DIM) -> FusedCall:
    """Random q [1, H, L, D], k/v [1, Hkv, L, D] (causal: 2 kv heads, as LLaMA's grouped queries)."""
    generator = torch.Generator().manual_seed(0)
    kv_heads = 2 if causal else heads

    def randn(count: int) -> torch.Tensor:
        return torch.randn(1, count, length, dim, generator=generator).to(dtype).requires_grad_()

    positions = torch.arange(length)
    return FusedCall(randn(heads), randn(kv_heads), randn(kv_heads), None, positions, positions, 0, causal,
                     dim**-0.5, 0.0, {}, (0, 0))


def dense(bias: BiasPositions, call: FusedCall) -> torch.Tensor:
    """The dense path: the scheme's bias merged into a mask of the call's dtype, as ``scheme_inputs`` does, then
    sdpa: output [B, q, H, D]."""
    full = bias(call.query_pos, call.key_pos, 0, call.causal, {})
    allowed = call.key_pos[None, :] <= call.query_pos[:, None] if call.causal else None
    mask = merge_bias_and_mask(full, None, allowed, call.query.dtype)
    groups = call.query.shape[1] // call.key.shape[1]
    key, value = (t.repeat_interleave(groups, 1) for t in (call.key, call.value))
    return F.scaled_dot_product_attention(call.query, key, value, attn_mask=mask, scale=call.scaling).transpose(1, 2)


def reference(bias: BiasPositions, call: FusedCall) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """float64 attention on the call's own inputs, the scheme's parameters in float64: (output [B, q, H, D], its
    inputs: the parameter, q, k, v)."""
    wide = copy.deepcopy(bias).double().requires_grad_()
    query, key, value = (t.detach().double().requires_grad_() for t in (call.query, call.key, call.value))
    exact = wide(call.query_pos, call.key_pos, 0, call.causal, None)
    if call.causal:
        exact = exact.masked_fill(call.key_pos[None, :] > call.query_pos[:, None], float("-inf"))
    groups = query.shape[1] // key.shape[1]
    key_all, value_all = (t.repeat_interleave(groups, 1) for t in (key, value))
    weights = torch.softmax(query @ key_all.transpose(-1, -2) * call.scaling + exact, dim=-1)
    return (weights @ value_all).transpose(1, 2), [parameter(wide), query, key, value]


def parameter(bias: BiasPositions) -> torch.Tensor:
    return bias.slopes if isinstance(bias, AlibiBias) else bias.tables[0].weight


def run_paths(name: str, causal: bool, dtype: torch.dtype, trainable: bool, length: int = LENGTH) -> dict:
    """{path: (output, gradients)} of the fused, dense and float64 paths on one random call; gradients of q, k, v
    and, when ``trainable``, first of the slopes / table."""
    bias, call = scheme(name, HEADS, trainable), make_call(length, causal, dtype, HEADS, DIM)
    weights = torch.randn(1, length, HEADS, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = {}
    for path in ("fused", "dense", "reference"):
        inputs = [parameter(bias), call.query, call.key, call.value]
        if path == "fused":
            output = bias.fused_attention(call)
            assert output is not None, "the fused form declined a half-precision call"
        elif path == "dense":
            output = dense(bias, call)
        else:
            output, inputs = reference(bias, call)
        inputs = inputs if trainable else inputs[1:]
        grads = torch.autograd.grad((output.double() * weights).sum(), inputs)
        results[path] = (output.detach().double(), [g.double() for g in grads])
    return results


def errors(results: dict, path: str, trainable: bool) -> dict[str, float]:
    """Max |path - reference| of the output, and of each gradient relative to the reference gradient's largest."""
    output, grads = results[path]
    want, want_grads = results["reference"]
    found = {"output": (output - want).abs().max().item()}
    labels = ["param", "dq", "dk", "dv"] if trainable else ["dq", "dk", "dv"]
    for label, got, expected in zip(labels, grads, want_grads, strict=True):
        found[label] = ((got - expected).abs().max() / expected.abs().max()).item()
    return found


CASES = [("alibi", True), ("alibi", False), ("t5", True), ("t5", False)]
CASE_IDS = ["alibi-causal", "alibi-bidirectional", "t5-causal", "t5-bidirectional"]
#: how far the fused error may pass the dense one (see the test's docstring for the measured ratios)
RATIO = {"output": 1.25, "param": 1.25, "dq": 1.5, "dk": 1.5, "dv": 1.5}
#: with a trainable bias the dense mask requires a gradient and sdpa runs its math fallback, which computes half
#: precision in float32 (q, k, v gradients 1.5x more exact than any fused kernel's backward)
RATIO_TRAINABLE = {**RATIO, "dq": 2.0, "dk": 2.0, "dv": 2.0}


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("name", "causal"), CASES, ids=CASE_IDS)
def test_fused_is_as_exact_as_dense(name: str, causal: bool, dtype: torch.dtype, trainable: bool) -> None:
    """LENGTH tokens (T5 past its saturation distance of 113), HEADS heads of DIM: the output and every gradient
    (slopes or table, q, k, v) against float64. Measured, fused error / dense error over bf16 and fp16: output
    0.51 - 1.00 (the fused output carries its own rounding, the dense one its bias's too); frozen bias (both paths
    run sdpa's fused kernel and its backward): q/k/v gradients 0.33 - 1.17; trainable: slopes / table gradient
    0.25 - 0.93, q/k/v 0.54 - 1.47 (RATIO_TRAINABLE)."""
    results = run_paths(name, causal, dtype, trainable)
    fused, dense_errors = errors(results, "fused", trainable), errors(results, "dense", trainable)
    ratio = RATIO_TRAINABLE if trainable else RATIO
    for label, error in fused.items():
        assert error <= ratio[label] * dense_errors[label], (label, fused, dense_errors)


def sample_rows(length: int) -> torch.Tensor:
    """The first, middle and last 128 queries (the rows farthest from and nearest to the separable form's
    reference position)."""
    middle = length // 2
    return torch.cat([torch.arange(128), torch.arange(middle - 64, middle + 64), torch.arange(length - 128, length)])


@pytest.mark.parametrize("length", [2048, pytest.param(8192, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("name", "causal"), CASES, ids=CASE_IDS)
def test_long_inputs_are_as_exact_as_dense(name: str, causal: bool, length: int) -> None:
    """bfloat16, 8 heads of 64, fixed slopes / table: the output on sampled rows against float64. Offsets j - c pass
    256 here, where one bfloat16 column could not hold them. Measured max / rms error, 2,048 | 8,192 tokens:

    ==================  =====================================  =====================================  =================
    case                fused                                  dense                                  floor
    ==================  =====================================  =====================================  =================
    ALiBi causal        8.0e-3 / 7.0e-4 | 8.4e-3 / 6.9e-4      9.1e-3 / 9.1e-4 | 1.0e-2 / 9.0e-4      7.8e-3 / 6.1e-4
    ALiBi bidirectional 7.3e-3 / 5.5e-4 | 8.3e-3 / 5.5e-4      1.2e-2 / 7.3e-4 | 9.5e-3 / 7.4e-4      7.3e-3 / 4.7e-4
    T5 causal           7.8e-3 / 4.6e-4 | 7.6e-3 / 4.2e-4      1.5e-2 / 1.0e-3 | 1.3e-2 / 9.3e-4      7.8e-3 / 4.6e-4
    T5 bidirectional    3.8e-3 / 1.9e-4 | 3.8e-3 / 1.2e-4      8.1e-3 / 4.3e-4 | 6.5e-3 / 2.6e-4      3.8e-3 / 1.8e-4
    ==================  =====================================  =====================================  =================

    (floor: the float64 output rounded to bfloat16, at 2,048). The dense path rounds its bias to bfloat16; the
    fused forms sit within 15% of the floor's rms."""
    bias = scheme(name, HEADS, trainable=False)
    call = make_call(length, causal, torch.bfloat16)
    rows = sample_rows(length)
    with torch.no_grad():
        fused = bias.fused_attention(call)[:, rows].double()
        dense_output = dense(bias, call)[:, rows].double()
        narrow = dataclasses.replace(call, query=call.query[:, :, rows], query_pos=rows)
        want = reference(bias, narrow)[0]
    fused_error, dense_error = fused - want, dense_output - want  # 5%: both round the same numbers, differently
    assert fused_error.abs().max() <= 1.05 * dense_error.abs().max()
    assert fused_error.square().mean().sqrt() <= 1.05 * dense_error.square().mean().sqrt()


# --- whole models: a bfloat16 model, and a float32 model under CPU autocast ------------------------------------------

FAMILIES = ["llama", "gpt2", "bert"]  # grouped-query causal, causal, bidirectional
MODES = ["bf16-model", "autocast"]


def swapped_model(family: str, name: str) -> nn.Module:
    """A tiny model with ALiBi (trainable slopes, off the powers of two) or T5 (8 buckets / 16: the saturation
    distance within the 40 tokens; a random table)."""
    model = make_model(family, "sdpa")
    ps.swap(model, ps.AlibiConfig(trainable_slopes=True) if name == "alibi" else ps.T5BiasConfig(8, 16))
    with torch.no_grad():
        positions = model.base_model.posswap_positions
        if name == "alibi":
            positions.slopes.mul_(1.37)
        else:
            positions.tables[0].weight.normal_(std=2.0, generator=torch.Generator().manual_seed(5))
    return model


def forward_backward(model: nn.Module, input_ids: torch.Tensor, mode: str, fused: bool = True) -> tuple:
    """(logits float64, {parameter name: gradient float64}, the set of attention paths) of one forward and backward
    of a loss on the logits; ``mode`` autocast runs both under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    positions = model.base_model.posswap_positions
    positions.fused_min_queries = type(positions).fused_min_queries if fused else None  # None: the dense path
    model.zero_grad(set_to_none=True)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    with record_paths() as paths, precision:
        logits = model(input_ids=input_ids).logits
        logits.float().square().mean().backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double(), grads, set(paths)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def all_grads(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


#: fused vs dense, both in half precision: logits max |difference| / max |logit|, measured up to 6.6e-3 (about two
#: bfloat16 roundings of the largest logit); every parameter's gradient, norm-relative, up to 5.0e-3; the bias's own
#: (slopes, table), up to 1.1e-2 (a sum over few terms in these tiny models)
MODEL_TOLERANCE = {"logits": 1.5e-2, "grads": 1e-2, "bias": 2.5e-2}
#: errors against float64 sum the whole network's rounding, and the two paths round at different places: the
#: fused error, measured, is 0.5 - 1.2x the dense one for logits and all gradients, up to 1.36x for the bias's own
MODEL_RATIO = {"logits": 1.5, "grads": 1.5, "bias": 2.0}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["alibi", "t5"])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_fused_equals_dense(family: str, name: str, mode: str) -> None:
    """A bfloat16 model, or a float32 one under CPU autocast: every attention call takes the fused path (the dense
    run, the dense one), logits and every parameter's gradient agree with the dense path's, and neither is further
    from float64 than the dense path's (tolerances above)."""
    model = swapped_model(family, name)
    if mode == "bf16-model":
        model.to(torch.bfloat16)
    input_ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    fused_logits, fused_grads, fused_paths = forward_backward(model, input_ids, mode)
    dense_logits, dense_grads, dense_paths = forward_backward(model, input_ids, mode, fused=False)
    want_logits, want_grads, _ = forward_backward(copy.deepcopy(model).double(), input_ids, "float64", fused=False)
    assert fused_paths == {PATHS[name]} and dense_paths == {DENSE}
    bias = next(parameter for parameter in want_grads if "posswap" in parameter)  # the slopes' or table's name
    found = {
        "logits": ((fused_logits - dense_logits).abs().max() / dense_logits.abs().max()).item(),
        "grads": relative(all_grads(fused_grads), all_grads(dense_grads)),
        "bias": relative(fused_grads[bias], dense_grads[bias]),
    }
    assert all(found[key] <= MODEL_TOLERANCE[key] for key in found), found
    errors = {
        path: {
            "logits": ((logits - want_logits).abs().max() / want_logits.abs().max()).item(),
            "grads": relative(all_grads(grads), all_grads(want_grads)),
            "bias": relative(grads[bias], want_grads[bias]),
        }
        for path, logits, grads in [("fused", fused_logits, fused_grads), ("dense", dense_logits, dense_grads)]
    }
    assert all(errors["fused"][key] <= MODEL_RATIO[key] * errors["dense"][key] for key in found), errors


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["alibi", "t5"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cached_decoding_equals_uncached(family: str, name: str, mode: str) -> None:
    """Greedy generation with a KV cache (prefill fused; ALiBi decoding steps fused too, T5's dense: one bias row)
    gives the logits of uncached forwards over the same tokens, within the fused-vs-dense logit tolerance."""
    model = swapped_model(family, name)
    if mode == "bf16-model":
        model.to(torch.bfloat16)
    input_ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    with torch.no_grad(), precision, record_paths() as paths:
        generated = model.generate(input_ids, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True,
                                   return_dict_in_generate=True, output_logits=True)
        cached = torch.stack(generated.logits, dim=1).double()  # [1, new, vocab]
        uncached = model(input_ids=generated.sequences[:, :-1], use_cache=False).logits[:, 19:].double()
    assert PATHS[name] in paths
    assert ((cached - uncached).abs().max() / uncached.abs().max()).item() <= MODEL_TOLERANCE["logits"]


# --- autocast: the fused forms get q, k, v as sdpa does -------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_autocast_inputs_are_what_sdpa_gets_under_autocast(dtype: torch.dtype) -> None:
    """torch's CPU autocast runs scaled_dot_product_attention in the autocast dtype (every floating input but float64
    cast): sdpa under autocast equals sdpa on autocast_inputs' tensors without it, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 8, 16, generator=generator) for _ in range(3))
    with torch.autocast("cpu", dtype=dtype):
        under = F.scaled_dot_product_attention(query, key.to(dtype), value)
        cast = autocast_inputs(query, key.to(dtype), value)
        assert autocast_inputs(query.double())[0].dtype == torch.float64  # autocast leaves float64 alone
        assert F.scaled_dot_product_attention(*(t.double() for t in (query, key, value))).dtype == torch.float64
    assert [t.dtype for t in cast] == [dtype] * 3 and under.dtype == dtype
    assert torch.equal(F.scaled_dot_product_attention(*cast), under)


# --- memory: no [B, H, q, kv] tensor -------------------------------------------------------------------------------


class LargestStorage(TorchDispatchMode):
    """Records the largest storage (in elements of its tensor's dtype) any operation produces: a strided view of a
    small tensor (the Toeplitz bias) counts as small."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.Tensor) and item.layout == torch.strided and item.device.type != "meta":
                self.largest = max(self.largest, item.untyped_storage().nbytes() // item.element_size())
        return result


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize(("name", "causal"), CASES, ids=CASE_IDS)
def test_no_tensor_of_the_dense_bias_size(name: str, causal: bool, grad: bool) -> None:
    """1,024 bfloat16 tokens, 2 heads of 16: the largest tensor the fused form makes (forward, and backward when
    training) stays below one [1, H, q, kv] bias; the dense path, probed the same way, makes one. Training trains
    the bias too, but for bidirectional ALiBi: trainable slopes there make the Toeplitz bias need a gradient, which
    sdpa's fused kernel does not give, so sdpa runs its math fallback with [B, H, q, kv] weights (as the dense path
    does, in every dtype)."""
    length, heads = 1024, 2
    trainable = grad and (name == "t5" or causal)
    bias, call = scheme(name, heads, trainable), make_call(length, causal, torch.bfloat16, heads, 16)
    dense_size = heads * length * length
    with torch.set_grad_enabled(grad):
        with LargestStorage() as probe:
            output = bias.fused_attention(call)
            assert output is not None
            if grad:
                output.float().sum().backward()
        with LargestStorage() as dense_probe:
            dense(bias, call)
    assert probe.largest < dense_size <= dense_probe.largest, (probe.largest, dense_size)
