"""Training through ``flex_attention``: logits and every position parameter's gradient equal the dense path's.

On CPU, compiled flex with the aot_eager backend runs flex's own reference backward (from the same joint graph the
CUDA kernel is built from, each one put through inductor's check), with left padding and the parameters spread
over ``FLEX_LANES`` copies; the reference is the eager carrier (always the dense bias). The test named ``cuda``
needs a GPU (compiled flex, fp32 and bf16 autocast, 300 tokens over several blocks) and is skipped without one.
"""

from __future__ import annotations

import importlib

import flex_cases
import pytest
import torch
from flex_cases import ATOL, LENGTH, SCHEMES, build, matrix, tokens

from hf_posswap.core import flex_bias
from hf_posswap.core.paths import DENSE, FLEX, record_paths

flex_on_cpu = flex_cases.flex_on_cpu  # the shared fixture (assigned: ruff reads an imported one as unused)


# ---------------------------------------------------------------------------------------------------------------
# Gradients through flex: flex's own reference backward on CPU, the compiled kernel on CUDA.


def loss_and_grads(model: torch.nn.Module, inputs: dict, attn: str = "posswap_sdpa",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict, set]:
    """(logits, gradients of the position parameters, paths) of a loss over the real (unpadded) tokens, through the
    carrier ``attn`` (the eager one always takes the dense path), under autocast to ``dtype`` unless float32."""
    device_type = inputs["input_ids"].device.type
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(attn)
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32), record_paths() as paths:
        logits = model(**inputs).logits
    model.set_attn_implementation("posswap_sdpa")
    real = inputs["attention_mask"][..., None]
    (logits.float().square() * real).mean().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.base_model.posswap_positions.named_parameters()
             if p.grad is not None}
    return logits.detach().float(), grads, set(paths)


def padded_inputs(length: int, device: str = "cpu") -> dict:
    input_ids = tokens(2, length).to(device)
    mask = torch.ones_like(input_ids)
    mask[1, : length // 5] = 0
    return {"input_ids": input_ids, "attention_mask": mask}


def largest_errors(got: tuple, want: tuple, real: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference| on real tokens, max |gradient difference| over every position parameter / the
    largest |gradient| of any of them). One scale for all: some gradients are 0 up to rounding (FIRE's output bias
    adds one constant per head to every score of a row, which softmax ignores), so each one's own scale is noise."""
    logits = float((got[0][real] - want[0][real]).abs().max())
    scale = max((float(grad.abs().max()) for grad in want[1].values()), default=0.0) + 1e-12
    grads = [float((got[1][name] - grad).abs().max()) / scale for name, grad in want[1].items()]
    return logits, max(grads, default=0.0)


@pytest.fixture
def flex_backward_on_cpu(flex_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled flex on CPU with the aot_eager backend: flex's reference backward computes the gradients of the
    captured tensors from the same joint graph the CUDA kernel is built from, and each joint graph goes through
    inductor's check (a captured tensor that needs a gradient may be gathered once). Uses torch internals (the
    CPU refusal of inputs that need a gradient is lifted); skipped where they differ."""
    flex = importlib.import_module("torch.nn.attention.flex_attention")
    hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    try:
        from torch._inductor.kernel.flex.flex_attention import validate_joint_graph
    except ImportError:
        pytest.skip("this torch has no validate_joint_graph")
    if not hasattr(flex, "_validate_device") or not hasattr(hop, "create_fw_bw_graph"):
        pytest.skip("this torch's flex_attention internals differ")
    original = hop.create_fw_bw_graph

    def checked(*args, **kwargs):
        forward, joint = original(*args, **kwargs)
        validate_joint_graph(joint.graph)
        return forward, joint

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    monkeypatch.setattr(hop, "create_fw_bw_graph", checked)
    monkeypatch.setattr(flex_bias, "FLEX_COMPILED_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(flex_bias, "FLEX_BACKEND", "aot_eager")


BACKWARD = matrix(["llama", "bert"], list(SCHEMES), {"llama-fire", "bert-kerple-power"})


@pytest.mark.parametrize(("family", "scheme"), BACKWARD)
def test_gradients_through_flex_equal_dense(family: str, scheme: str, flex_backward_on_cpu: None) -> None:
    """Training through flex (left padding; parameters spread over FLEX_LANES copies): logits and every position
    parameter's gradient equal the dense path's."""
    model = build(family, scheme).train()
    inputs = padded_inputs(LENGTH)
    flex, dense = loss_and_grads(model, inputs), loss_and_grads(model, inputs, "posswap_eager")
    assert flex[2] == {FLEX} and dense[2] == {DENSE}
    assert flex[1].keys() == dense[1].keys() and (flex[1] or scheme == "sandwich")  # sandwich has no parameters
    logit_error, grad_error = largest_errors(flex, dense, inputs["attention_mask"].bool())
    assert logit_error <= ATOL and grad_error <= 1e-5, (logit_error, grad_error)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention needs CUDA")
CUDA_SCHEMES = ["alibi", "t5", "kerple-log", "kerple-power", "sandwich", "fire", "head-mix"]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(("family", "scheme"), matrix(["llama", "bert"], CUDA_SCHEMES, {"llama-fire"}))
def test_cuda_compiled_flex_forward_and_backward(family: str, scheme: str, dtype: torch.dtype) -> None:
    """Compiled flex on CUDA (300 tokens: several blocks of 128, left padding), against the fp32 dense path (the
    eager carrier): logits on real tokens within 1e-4 and every position parameter's gradient within 1e-3 of the
    largest one (sums over every score). bf16 autocast: no further from fp32 than the dense path in bf16 is (plus
    1e-2)."""
    model = build(family, scheme).cuda().train()
    inputs = padded_inputs(300, "cuda")
    real = inputs["attention_mask"].bool()
    flex = loss_and_grads(model, inputs, dtype=dtype)
    assert flex[2] == {FLEX}
    reference = loss_and_grads(model, inputs, "posswap_eager")
    assert reference[2] == {DENSE} and flex[1].keys() == reference[1].keys()
    assert flex[1] or scheme == "sandwich", "no position parameter got a gradient"  # sandwich has no parameters
    flex_errors = largest_errors(flex, reference, real)
    if dtype == torch.float32:
        print(f"{family}-{scheme} fp32 flex - dense: logits {flex_errors[0]:.3g}, gradients {flex_errors[1]:.3g}")
        assert flex_errors[0] <= 1e-4 and flex_errors[1] <= 1e-3, flex_errors
        return
    dense_errors = largest_errors(loss_and_grads(model, inputs, "posswap_eager", dtype), reference, real)
    print(f"{family}-{scheme} bf16 vs fp32 dense: flex logits {flex_errors[0]:.3g} gradients {flex_errors[1]:.3g}; "
          f"dense bf16 logits {dense_errors[0]:.3g} gradients {dense_errors[1]:.3g}")
    for flex_error, dense_error in zip(flex_errors, dense_errors, strict=True):
        assert flex_error <= 2 * dense_error + 1e-2, (flex_errors, dense_errors)
