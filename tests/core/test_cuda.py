"""The family x scheme matrix on a CUDA GPU: swapped models give there the numbers they give on CPU.

Runs only where CUDA exists (``scripts/gpu_check.sh`` runs it on a lent GPU); skipped elsewhere. To rehearse the
test logic without a GPU, ``POSSWAP_TEST_DEVICE=cpu pytest tests/core/test_cuda.py -m "slow or not slow"`` runs every
check on the CPU instead (the device-specific paths then are the CPU's).

What is checked, per family x scheme (tiny models from configs, LLaMA with grouped-query attention):

- ``.to(device)`` after the swap: fp32 logits equal the CPU's (the CPU run is the reference nobody tuned);
- bf16 on the device: the sdpa carrier (flex_attention for bias schemes) and the eager carrier (dense bias) are
  each as close to the fp32 result as bf16 allows, and the bias schemes' long calls took the flex path;
- cached decoding equals one uncached forward (bf16 and fp32), a left-padded batch equals its rows alone;
- ``generate`` (greedy, beams, sampling with a seed) runs, greedy equal to the CPU's tokens in fp32, and with a static
  cache, which it then compiles by itself (inductor), gives eager ``generate``'s tokens without recompiling per step;
- backward: the position parameters' gradients equal the CPU's (fp32) and are finite and close in bf16;
- ``device_map="auto"`` loading of a saved swapped checkpoint and a short accelerate fine-tune in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import CAUSAL_FAMILIES, FAMILIES, VOCAB, padding_position_ids, save_tiny_checkpoint, swapped, write_corpus

import hf_posswap as ps
from hf_posswap.core.paths import record_paths
from hf_posswap.transformers_internals import CACHE_KWARG, find_cache_in_output

DEVICE = os.environ.get("POSSWAP_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (POSSWAP_TEST_DEVICE=cpu rehearses it on the CPU)", allow_module_level=True)
pytestmark = pytest.mark.gpu

#: schemes whose long calls should leave the dense bias behind on CUDA
BIAS_SCHEMES = {"alibi", "t5", "kerple", "sandwich", "fire"}
#: schemes of the GPU matrix: every registered one
SCHEMES = ps.available_schemes()
MATRIX = [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in SCHEMES]
CAUSAL_MATRIX = [pytest.param(f, s, id=f"{f}-{s}") for f in CAUSAL_FAMILIES for s in SCHEMES]
LENGTH = 48  # long enough for the fused / flex forms (they leave single decoding steps to the dense bias)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def swapped_or_skip(family: str, scheme: str, attn: str = "sdpa") -> torch.nn.Module:
    try:
        return swapped(family, scheme, attn)
    except ps.PosSwapError as error:  # pairs swap refuses (e.g. no rotary slot): the CPU matrix tests the refusal
        pytest.skip(f"swap refuses {family}-{scheme}: {type(error).__name__}")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| / max |reference| (float32)."""
    value, reference = value.float().cpu(), reference.float().cpu()
    return float((value - reference).abs().max() / reference.abs().max().clamp(min=1e-6))


def position_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: model.get_parameter(name) for name, _shape, trainable in ps.describe(model).new_parameters
            if trainable}


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_moved_after_swap_matches_cpu(family: str, scheme: str) -> None:
    model = swapped_or_skip(family, scheme)
    input_ids = tokens(2, LENGTH)
    with torch.no_grad():
        on_cpu = model(input_ids=input_ids).logits
        model.to(DEVICE)
        on_device = model(input_ids=input_ids.to(DEVICE)).logits
    torch.testing.assert_close(on_device.cpu(), on_cpu, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_bf16_eager_and_sdpa_within_bf16_of_fp32(family: str, scheme: str) -> None:
    """Both carriers in bf16 against the fp32 model on the same device; neither may be much worse than the other
    (the eager carrier is the plain dense computation, so it measures what bf16 itself costs)."""
    reference_model = swapped_or_skip(family, scheme).to(DEVICE)
    input_ids = tokens(2, LENGTH).to(DEVICE)
    mask = torch.ones_like(input_ids)
    mask[1, :7] = 0
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": padding_position_ids(mask)}
    if family == "roberta":
        kwargs["position_ids"] = kwargs["position_ids"] + reference_model.config.pad_token_id + 1
    errors = {}
    with torch.no_grad():
        reference = reference_model(**kwargs).logits[mask.bool()]
        for attn in ("eager", "sdpa"):
            model = swapped(family, scheme, attn).to(DEVICE, torch.bfloat16)
            with record_paths() as paths:
                logits = model(**kwargs).logits[mask.bool()]
            assert torch.isfinite(logits).all(), attn
            errors[attn] = relative_error(logits, reference)
            if attn == "sdpa" and scheme in BIAS_SCHEMES and DEVICE == "cuda":
                assert "dense" not in paths, f"bf16 {scheme} on CUDA built the dense bias: {paths}"
    assert errors["sdpa"] <= 2 * errors["eager"] + 2e-2, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
def test_cached_decode_equals_one_forward(family: str, scheme: str, dtype: torch.dtype) -> None:
    model = swapped_or_skip(family, scheme).to(DEVICE, dtype)
    input_ids = tokens(1, LENGTH).to(DEVICE)
    prompt = LENGTH - 8
    with torch.no_grad():
        full = model(input_ids=input_ids).logits
        out = model(input_ids=input_ids[:, :prompt], use_cache=True)
        steps, cache = [out.logits], find_cache_in_output(out)
        for index in range(prompt, LENGTH):
            out = model(input_ids=input_ids[:, index : index + 1], use_cache=True, **{CACHE_KWARG: cache})
            steps.append(out.logits)
            cache = find_cache_in_output(out)
    cached = torch.cat(steps, dim=1)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert relative_error(cached, full) <= tolerance


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_left_padded_batch_equals_rows_alone(family: str, scheme: str) -> None:
    model = swapped_or_skip(family, scheme).to(DEVICE)
    rows = [tokens(1, LENGTH, seed=4)[0], tokens(1, LENGTH - 13, seed=5)[0]]
    batch = torch.zeros(2, LENGTH, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, LENGTH - len(row):] = row
        mask[i, LENGTH - len(row):] = 1
    position_ids = padding_position_ids(mask)
    if family == "roberta":
        position_ids = position_ids + model.config.pad_token_id + 1
    with torch.no_grad():
        together = model(input_ids=batch.to(DEVICE), attention_mask=mask.to(DEVICE),
                         position_ids=position_ids.to(DEVICE)).logits.cpu()
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None].to(DEVICE)).logits[0].cpu()
            torch.testing.assert_close(together[i, LENGTH - len(row):], alone, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(("family", "scheme"), CAUSAL_MATRIX)
def test_generate_greedy_beams_sampling(family: str, scheme: str) -> None:
    model = swapped_or_skip(family, scheme)
    input_ids = tokens(1, LENGTH - 16)
    settings = {"max_new_tokens": 12, "min_new_tokens": 12, "pad_token_id": 0}
    on_cpu = model.generate(input_ids, do_sample=False, **settings)
    model.to(DEVICE)
    on_device = model.generate(input_ids.to(DEVICE), do_sample=False, **settings).cpu()
    assert torch.equal(on_device, on_cpu)
    beams = model.generate(input_ids.to(DEVICE), num_beams=3, do_sample=False, **settings)
    torch.manual_seed(0)
    sampled = model.generate(input_ids.to(DEVICE), do_sample=True, top_k=20, **settings)
    assert beams.shape[1] == sampled.shape[1] == LENGTH - 16 + 12


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_generate_compiles_itself_with_a_static_cache(scheme: str) -> None:
    """``generate`` with a static cache compiles the forward by itself on a GPU (inductor, CUDA graphs): the same
    tokens as eager ``generate``, and no more graphs for 20 new tokens than for 3 (no recompiling per step)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = swapped_or_skip("llama", scheme).to(DEVICE).eval()
    input_ids = tokens(1, LENGTH - 16).to(DEVICE)

    def generate(new_tokens: int, compiled: bool) -> torch.Tensor:
        settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
                    "pad_token_id": 0, "cache_implementation": "static"}
        if compiled and DEVICE != "cuda":  # the CPU rehearsal: generate compiles only on accelerators by itself
            config = CompileConfig()
            config._compile_all_devices = True
            settings["compile_config"] = config
        return model.generate(input_ids, disable_compile=not compiled, **settings)

    graphs = []
    for new_tokens in (3, 20):
        torch._dynamo.reset()
        counters.clear()
        compiled_tokens = generate(new_tokens, compiled=True)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], f"graphs for 3 and 20 new tokens: {graphs}"
    assert torch.equal(compiled_tokens, generate(20, compiled=False))


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_position_gradients_match_cpu(family: str, scheme: str) -> None:
    cpu_model = swapped_or_skip(family, scheme).train()
    parameters = position_parameters(cpu_model)
    if not parameters:
        pytest.skip(f"{scheme} has no trainable position parameters")
    input_ids = tokens(2, LENGTH)
    cpu_model(input_ids=input_ids, labels=input_ids).loss.backward()
    expected = {name: param.grad.clone() for name, param in parameters.items()}
    # a gradient that is zero in exact arithmetic (FIRE's output bias shifts whole rows, which softmax ignores) is
    # compared on the scale of the largest position gradient, not its own rounding noise
    scale = max(float(grad.abs().max()) for grad in expected.values())
    for dtype, tolerance in ((torch.float32, 2e-3), (torch.bfloat16, 1.5e-1)):
        model = swapped(family, scheme).train().to(DEVICE, dtype)
        ids = input_ids.to(DEVICE)
        model(input_ids=ids, labels=ids).loss.backward()
        for name, param in position_parameters(model).items():
            assert param.grad is not None and torch.isfinite(param.grad).all(), (dtype, name)
            error = (param.grad.float().cpu() - expected[name]).abs().max()
            size = max(float(expected[name].abs().max()), 0.1 * scale)
            assert float(error) <= tolerance * size, (dtype, name, float(error), size)


@pytest.mark.parametrize("scheme", ["alibi", "t5", "kerple", "fire", "rope"])
def test_device_map_auto_loads_a_saved_swap(tmp_path, scheme: str) -> None:
    from transformers import AutoModelForCausalLM

    model = swapped("llama", scheme)
    model.save_pretrained(tmp_path)
    input_ids = tokens(1, LENGTH)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto" if DEVICE == "cuda" else DEVICE)
        assert loaded.device.type == DEVICE
        actual = loaded(input_ids=input_ids.to(loaded.device)).logits.cpu()
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("scheme", ["alibi", "t5", "kerple"])
def test_accelerate_finetune_in_bf16(tmp_path, scheme: str) -> None:
    from hf_posswap.training import FinetuneConfig, finetune

    checkpoint = save_tiny_checkpoint("llama", tmp_path / "base")
    data = write_corpus(tmp_path, documents=8)
    output = tmp_path / "run"
    result = finetune(FinetuneConfig(
        model=str(checkpoint), data=data, output=str(output), scheme=scheme, seq_len=64, batch_size=2, steps=4,
        mixed_precision="bf16" if DEVICE == "cuda" else "no", eval_fraction=0.2, eval_every=4, save_every=4,
        progress=False,
    ))
    assert all(torch.isfinite(torch.tensor(float(result[k]))) for k in ("train_loss", "eval_loss")), result
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(result["output"])
    assert ps.describe(reloaded).scheme == scheme


#: long enough that flex_attention works over several 128-key blocks (and a partial last one)
LONG = 700
LONG_CASES = {
    "alibi": lambda: ps.AlibiConfig(),
    "t5": lambda: ps.T5BiasConfig(num_buckets=16, max_distance=64),
    "kerple": lambda: ps.KerpleConfig(),
    "kerple-power": lambda: ps.KerpleConfig(variant="power"),
    "sandwich": lambda: ps.SandwichConfig(),
    "fire": lambda: ps.FireConfig(),
    "headmix": lambda: ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[2, 3]),
}


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Position parameters drawn at random (zero T5 tables or FIRE output layers would make any path agree)."""
    with torch.no_grad():
        for name, _shape, _trainable in ps.describe(model).new_parameters:
            param = model.get_parameter(name)
            param.add_(0.3 * torch.randn_like(param))
    return model


def long_model(family: str, case: str, attn: str) -> torch.nn.Module:
    from conftest import make_model

    model = make_model(family, attn)
    if case == "self_extend":
        return ps.extend_context(model, 2 * LONG, "self_extend", neighbor_window=16)
    ps.swap(model, LONG_CASES[case]())
    return randomised(model)


@pytest.mark.parametrize("case", [*LONG_CASES, "self_extend"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_long_inputs_match_the_dense_path(family: str, case: str) -> None:
    """700 tokens with a padded row: the sdpa carrier (flex on CUDA, over several key blocks) equals the eager
    carrier (dense bias) in fp32, and in bf16 stays within bf16 of the fp32 result."""
    if case == "self_extend" and family == "bert":
        pytest.skip("Self-Extend extends rotary models")
    input_ids = tokens(2, LONG).to(DEVICE)
    mask = torch.ones_like(input_ids)
    mask[1, :150] = 0
    kwargs = {"input_ids": input_ids, "attention_mask": mask}
    with torch.no_grad():
        dense = long_model(family, case, "eager").to(DEVICE)(**kwargs).logits[mask.bool()]
        model = long_model(family, case, "sdpa").to(DEVICE)
        with record_paths() as paths:
            fused = model(**kwargs).logits[mask.bool()]
        assert relative_error(fused, dense) <= 1e-4, paths
        bf16 = model.to(torch.bfloat16)(**kwargs).logits[mask.bool()]
    assert relative_error(bf16, dense) <= 5e-2
    if DEVICE == "cuda" and case != "self_extend":
        assert "dense" not in paths, paths
