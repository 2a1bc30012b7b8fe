"""Bias schemes through ``flex_attention`` (``hf_posswap.core.flex_bias``): equal to the dense path.

On CPU the uncompiled flex runs (forward only, exact; it evaluates the mask function everywhere and ignores the
block structure), with ``FLEX_DEVICES`` patched to include ``"cpu"``. The reference is the eager carrier (always
the dense bias). Position parameters are randomised first: T5's zero tables and FIRE's zero output layer would
pass any code. The block masks, which only compiled flex reads, are checked block by block against the
elementwise mask. Tests named ``cuda`` need a GPU (compiled flex, gradients, bf16) and are skipped without one.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import VOCAB, make_model
from transformers import DynamicCache

import hf_posswap as ps
from hf_posswap.core import flex_bias
from hf_posswap.core.paths import DENSE, FLEX, record_paths
from hf_posswap.schemes.alibi import AlibiBias, alibi_slopes
from hf_posswap.schemes.base import FlexSpec, FusedCall
from hf_posswap.schemes.fire import FireBias
from hf_posswap.schemes.head_mix import HeadSelectedBias
from hf_posswap.schemes.kerple import KerpleBias, kerple_initial_values
from hf_posswap.schemes.sandwich import SandwichBias
from hf_posswap.schemes.t5 import T5RelativeBias

ATOL = RTOL = 1e-5  # float32, flex against the dense path
LENGTH = 40  # above FLEX_MIN_QUERIES, and past T5's max_distance (32 here) so its buckets saturate
T5 = {"num_buckets": 16, "max_distance": 32}

SCHEMES = {
    "alibi": lambda: ps.AlibiConfig(trainable_slopes=True),
    "t5": lambda: ps.T5BiasConfig(**T5),
    "t5-per-layer": lambda: ps.T5BiasConfig(**T5, shared_across_layers=False),
    "kerple-log": lambda: ps.KerpleConfig(variant="log"),
    "kerple-power": lambda: ps.KerpleConfig(variant="power"),
    "sandwich": lambda: ps.SandwichConfig(),
    "fire": lambda: ps.FireConfig(mlp_width=8),
    "head-mix": lambda: ps.HeadMix(bias=ps.KerpleConfig(), rotary="rope", bias_heads=[0, 1]),
    "layer-mix": lambda: ps.LayerMix(default="rope", overrides=[(ps.FireConfig(mlp_width=8), [1])]),
}
FAMILIES = ["llama", "gpt2", "bert"]  # GQA causal, MHA causal, bidirectional


def matrix(families: list[str], schemes: list[str], fast: set[str]) -> list:
    """(family, scheme) cases, ids "family-scheme"; those not in ``fast`` are marked slow. Each case's first flex
    call traces its score and mask functions (about 0.5 s on CPU), so the default run keeps a cross-section: every
    scheme once in a causal model and the bidirectional forms in BERT (``test_flex_bias_equals_forward`` checks
    every scheme, layout and direction elementwise)."""
    return [
        pytest.param(family, scheme, id=f"{family}-{scheme}",
                     marks=[] if f"{family}-{scheme}" in fast else [pytest.mark.slow])
        for family in families for scheme in schemes
    ]


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex_bias, "FLEX_DEVICES", {"cuda", "cpu"})


def randomise(model: torch.nn.Module) -> None:
    """Random values for every position parameter (as ``evaluation.self_check`` does)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.base_model.posswap_positions.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype))


def build(family: str, scheme: str) -> torch.nn.Module:
    model = make_model(family)
    ps.swap(model, SCHEMES[scheme]())
    randomise(model)
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def run(model: torch.nn.Module, attn: str = "posswap_sdpa", **inputs) -> tuple[torch.Tensor, set[str]]:
    """(logits, attention paths taken) under no_grad with the given carrier."""
    model.set_attn_implementation(attn)
    with torch.no_grad(), record_paths() as paths:
        logits = model(**inputs).logits
    model.set_attn_implementation("posswap_sdpa")
    return logits, set(paths)


def dense(model: torch.nn.Module, **inputs) -> torch.Tensor:
    return run(model, "posswap_eager", **inputs)[0]


# ---------------------------------------------------------------------------------------------------------------
# Whole models: flex = dense.


FAST_MODELS = {"llama-kerple-power", "llama-head-mix", "llama-layer-mix", "gpt2-sandwich", "bert-t5", "bert-fire"}


@pytest.mark.parametrize(("family", "scheme"), matrix(FAMILIES, list(SCHEMES), FAST_MODELS))
def test_flex_equals_dense(family: str, scheme: str, flex_on_cpu: None) -> None:
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids), atol=ATOL, rtol=RTOL)


PADDED = matrix(FAMILIES, ["t5", "kerple-power", "fire", "head-mix"], {"llama-t5", "bert-fire"})


@pytest.mark.parametrize(("family", "scheme"), PADDED)
def test_left_padded_batch(family: str, scheme: str, flex_on_cpu: None) -> None:
    """A bool padding mask from transformers: the mask function reads it. Padded query rows are not compared (flex
    gives fully masked rows 0, the dense path a uniform average)."""
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    mask = torch.ones_like(input_ids)
    mask[1, :7] = 0
    logits, paths = run(model, input_ids=input_ids, attention_mask=mask)
    assert paths == {FLEX}
    real = mask.bool()
    torch.testing.assert_close(logits[real], dense(model, input_ids=input_ids, attention_mask=mask)[real],
                               atol=ATOL, rtol=RTOL)


def test_sliding_window_layers_read_transformers_mask(flex_on_cpu: None) -> None:
    """Gemma 3's local layer (window 16) gets a sliding bool mask, its global layer a causal one."""
    model = build("gemma3_text", "kerple-log")
    input_ids = tokens(2, LENGTH)
    logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scheme", ["fire", *(pytest.param(name, marks=pytest.mark.slow)
                                             for name in ("alibi", "t5", "sandwich"))])
def test_chunked_prefill_after_a_cache(scheme: str, flex_on_cpu: None) -> None:
    """Two chunks of 20 after a DynamicCache (the second sees 40 keys, its queries start at 20) = one pass of 40."""
    model = build("llama", scheme)
    input_ids = tokens(2, LENGTH)
    cache = DynamicCache()
    first, first_paths = run(model, input_ids=input_ids[:, :20], past_key_values=cache)
    second, second_paths = run(model, input_ids=input_ids[:, 20:], past_key_values=cache)
    assert first_paths == second_paths == {FLEX}
    whole = dense(model, input_ids=input_ids)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("family", "scheme"), matrix(["llama", "bert"], ["alibi", "t5", "fire"],
                                                     {"llama-t5", "bert-alibi"}))
def test_explicit_position_ids(family: str, scheme: str, flex_on_cpu: None) -> None:
    """Per-row position ids with a gap (position skipping, PoSE): the score and mask functions gather by row."""
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    position_ids = torch.cat((torch.arange(20), torch.arange(50, 70)))[None].expand(2, -1)
    position_ids = position_ids + torch.tensor([[0], [5]])  # two rows, two offsets
    logits, paths = run(model, input_ids=input_ids, position_ids=position_ids)
    assert paths == {FLEX}
    torch.testing.assert_close(logits, dense(model, input_ids=input_ids, position_ids=position_ids),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("family", "scheme"), matrix(["llama", "bert"], ["alibi", "fire"], {"llama-fire"}))
def test_bfloat16_forward(family: str, scheme: str, flex_on_cpu: None) -> None:
    """A bf16 model through flex against the fp32 dense path: within what the dense path itself loses in bf16."""
    model = build(family, scheme)
    input_ids = tokens(2, LENGTH)
    reference = dense(model, input_ids=input_ids)
    dense_error = (dense(model.to(torch.bfloat16), input_ids=input_ids).float() - reference).abs().max()
    logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX} and logits.dtype == torch.bfloat16
    error = (logits.float() - reference).abs().max()
    assert error <= 2 * dense_error + 1e-2, (float(error), float(dense_error))


def test_autocast_casts_to_one_dtype(flex_on_cpu: None) -> None:
    model = build("llama", "kerple-log")
    input_ids = tokens(2, LENGTH)
    reference = dense(model, input_ids=input_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, paths = run(model, input_ids=input_ids)
    assert paths == {FLEX}
    assert (logits.float() - reference).abs().max() < 0.1


# ---------------------------------------------------------------------------------------------------------------
# Calls flex declines run the paths they ran before.


def test_decode_steps_and_short_chunks_keep_the_dense_bias(flex_on_cpu: None) -> None:
    model = build("llama", "kerple-log")
    input_ids = tokens(1, LENGTH)
    cache = DynamicCache()
    _, prefill = run(model, input_ids=input_ids[:, :30], past_key_values=cache)
    _, chunk = run(model, input_ids=input_ids[:, 30:30 + flex_bias.FLEX_MIN_QUERIES - 1], past_key_values=cache)
    assert prefill == {FLEX} and chunk == {DENSE}


def test_devices_outside_flex_devices_keep_their_paths() -> None:
    assert "cpu" not in flex_bias.FLEX_DEVICES
    for scheme, path in (("alibi", "fused-alibi"), ("kerple-log", DENSE)):
        _, paths = run(build("llama", scheme), input_ids=tokens(1, LENGTH))
        assert paths == {path}


def test_cpu_calls_that_need_a_gradient_keep_their_paths(flex_on_cpu: None) -> None:
    model = build("llama", "fire")
    with record_paths() as paths:
        model(input_ids=tokens(1, LENGTH)).logits.sum().backward()
    assert set(paths) == {DENSE}
    assert model.base_model.posswap_positions.functions[0].c.grad is not None


def test_eager_attention_keeps_the_dense_path(flex_on_cpu: None) -> None:
    _, paths = run(build("gpt2", "t5"), "posswap_eager", input_ids=tokens(1, LENGTH))
    assert paths == {DENSE}


@torch.no_grad()
def test_float_masks_and_float64_are_declined(flex_on_cpu: None) -> None:
    query, key = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8)
    assert flex_bias.flex_applies(query, key, key, None, 0.0)
    assert not flex_bias.flex_applies(query, key, key, torch.zeros(1, 1, 20, 20), 0.0)
    assert not flex_bias.flex_applies(query, key, key, None, 0.1)
    assert not flex_bias.flex_applies(query.double(), key.double(), key.double(), None, 0.0)
    assert not flex_bias.flex_applies(query[:, :, :15], key, key, None, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Each scheme's elementwise bias = its dense forward(), values and gradients.


def scheme_modules() -> dict:
    torch.manual_seed(0)
    heads = 6
    modules = {
        "alibi": AlibiBias(alibi_slopes(heads), trainable=True),
        "t5": T5RelativeBias(heads, 2, 16, 24, shared_across_layers=False),
        "kerple-log": KerpleBias(*kerple_initial_values(heads, "log"), "log"),
        "kerple-power": KerpleBias(*kerple_initial_values(heads, "power"), "power"),
        "sandwich": SandwichBias(heads, 16, 10000.0),
        "fire": FireBias(heads, 2, 8, 0.1, 30.0, shared=False),
        "head-mix": HeadSelectedBias(T5RelativeBias(heads, 2, 16, 24, True), [1, 4], heads),
    }
    with torch.no_grad():
        for module in modules.values():
            for parameter in module.parameters():
                parameter.copy_(torch.randn_like(parameter))
    return modules


POSITIONS = {  # (query positions, key positions): [q] / [kv], or [B, q] / [B, kv]
    "prefill": (torch.arange(50), torch.arange(50)),
    "chunk-after-cache": (torch.arange(30, 70), torch.arange(70)),
    "far-from-zero": (torch.arange(1000, 1040), torch.arange(960, 1040)),
    "rows": (torch.tensor([[0, 3, 4, 9, 30, 31], [7, 8, 60, 61, 62, 100]]),) * 2,
}


def spec_for(query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool, lanes: int = 1) -> FlexSpec:
    reach = int(max((key_pos.max() - query_pos.min()).abs(), (query_pos.max() - key_pos.min()).abs()))
    return FlexSpec(1, causal, reach, (int(query_pos.min()), int(query_pos.max())), torch.device("cpu"), lanes)


@pytest.mark.parametrize("lanes", [1, 1024], ids=["lanes-1", "lanes-1024"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("layout", list(POSITIONS))
@pytest.mark.parametrize("scheme", list(scheme_modules()))
def test_flex_bias_equals_forward(scheme: str, layout: str, causal: bool, lanes: int) -> None:
    """flex_bias evaluated on broadcast (head, query, key, lane) tensors equals forward() [B, H, q, kv], and gives
    the scheme's parameters the same gradients (the graph the captured tensors keep; lanes summed back)."""
    module = scheme_modules()[scheme]
    query_pos, key_pos = POSITIONS[layout]
    want = module(query_pos, key_pos, 1, causal)  # [1 or B, H, q, kv]
    bias = module.flex_bias(spec_for(query_pos, key_pos, causal, lanes))
    heads = torch.arange(want.shape[1])[None, :, None, None]  # [1, H, 1, 1]
    rows = query_pos.reshape(-1, 1, query_pos.shape[-1], 1), key_pos.reshape(-1, 1, 1, key_pos.shape[-1])
    lane = torch.randint(lanes, want.shape, generator=torch.Generator().manual_seed(2))
    got = bias(heads, *rows, lane)  # [1 or B, H, q, kv]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    parameters = [p for p in module.parameters() if p.requires_grad]
    if parameters:
        weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
        for expected, actual in zip(torch.autograd.grad((want * weights).sum(), parameters, allow_unused=True),
                                    torch.autograd.grad((got * weights).sum(), parameters, allow_unused=True),
                                    strict=True):
            if expected is None:
                assert actual is None or not actual.any()
            else:
                torch.testing.assert_close(actual, expected, atol=1e-3, rtol=1e-3)  # sums of thousands of terms


def test_t5_clamp_is_exact_past_max_distance() -> None:
    """The saturation the T5 function relies on: every relative position at or past max_distance shares a bucket."""
    module = scheme_modules()["t5"]
    for causal in (True, False):
        far = torch.arange(24, 5000)
        zero = torch.zeros(1, dtype=torch.long)
        bias = module.flex_bias(spec_for(far, zero, causal))
        heads = torch.arange(6)[:, None]
        queries_far = module(far, zero, 1, causal)[0, :, :, 0]  # [H, far] (spec_for says layer 1)
        keys_far = module(zero, far, 1, causal)[0, :, 0]
        torch.testing.assert_close(bias(heads, far[None], zero[None], zero), queries_far)
        torch.testing.assert_close(bias(heads, zero[None], far[None], zero), keys_far)


def test_fire_pieces_are_the_mlp() -> None:
    """FIRE's MLP as slope x + offset per piece between sorted kinks equals relu(x w1 + b1) w2 + b2 on a dense grid
    of x that crosses every kink, with a unit of w1 = 0 (no kink) among them."""
    function = scheme_modules()["fire"].functions[0]
    with torch.no_grad():
        function.mlp[0].weight[3] = 0.0
    kinks, slope, offset = function._pieces()
    x = torch.linspace(-6, 6, 20001)
    first, last = function.mlp[0], function.mlp[2]
    want = torch.relu(x[:, None] * first.weight[:, 0] + first.bias) @ last.weight.t() + last.bias  # [n, H]
    piece = (x[:, None] > kinks[None, :]).sum(-1)  # [n]
    got = slope[:, piece].t() * x[:, None] + offset[:, piece].t()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.isinf(kinks[-1])


@torch.no_grad()
def test_lanes_leave_the_output_unchanged(flex_on_cpu: None) -> None:
    """The lane of each score (which copy of a parameter it reads) changes nothing but where gradients accumulate."""
    module = scheme_modules()["fire"]
    call = position_call(torch.arange(160, 200), torch.arange(200))  # 200 keys: lanes of two key blocks
    call.key, call.value = torch.randn_like(call.key), torch.randn_like(call.value)
    call.query = torch.randn(2, 6, 40, 8)
    outputs = []
    for lanes in (1, 1024):
        spec = spec_for(call.query_pos, call.key_pos, True, lanes)
        outputs.append(flex_bias.flex_bias_output(call, module.flex_bias(spec), spec))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Block masks: what compiled flex reads (uncompiled flex ignores the blocks).


def dense_from_block_mask(block_mask, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The elementwise mask [B, q, kv] compiled flex applies: full blocks visible, partial blocks through mask_mod,
    other blocks hidden."""
    size = flex_bias.FLEX_BLOCK
    allowed = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    b, q, k = torch.meshgrid(torch.arange(batch), torch.arange(q_len), torch.arange(kv_len), indexing="ij")
    by_function = block_mask.mask_mod(b, torch.zeros_like(b), q, k)
    lists = ((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True),
             (block_mask.kv_num_blocks, block_mask.kv_indices, False))
    for counts, indices, full in lists:
        for row in range(batch):
            source = min(row, counts.shape[0] - 1)
            for q_block in range(counts.shape[2]):
                for kv_block in indices[source, 0, q_block, : counts[source, 0, q_block]].tolist():
                    rows = slice(q_block * size, (q_block + 1) * size)
                    cols = slice(kv_block * size, (kv_block + 1) * size)
                    allowed[row, rows, cols] = True if full else by_function[row, rows, cols]
    return allowed


def position_call(query_pos: torch.Tensor, key_pos: torch.Tensor, mask: torch.Tensor | None = None,
                  batch: int = 2) -> FusedCall:
    q_len, kv_len = query_pos.shape[-1], key_pos.shape[-1]
    query, key = torch.zeros(batch, 2, q_len, 8), torch.zeros(batch, 2, kv_len, 8)
    return FusedCall(query, key, key, mask, query_pos, key_pos, 0, True, 1.0, 0.0, {})


def shuffled_rows(count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.stack([torch.randperm(count, generator=generator) for _ in range(2)])  # [2, count]


def sliding_padded_mask(q_len: int, kv_len: int) -> torch.Tensor:
    query = torch.arange(kv_len - q_len, kv_len)[:, None]
    key = torch.arange(kv_len)[None]
    mask = (key <= query) & (key > query - 200)  # a window of 200 keys
    mask = mask[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :77] = False  # left padding of row 1
    return mask


BLOCK_CASES = {
    "prefill": lambda: position_call(torch.arange(300), torch.arange(300)),
    "chunk-after-cache": lambda: position_call(torch.arange(500, 700), torch.arange(700)),
    "static-buffer": lambda: position_call(torch.arange(100, 400), torch.arange(640)),
    "unordered-rows": lambda: position_call(shuffled_rows(333), shuffled_rows(333)),
    "sliding-padded-mask": lambda: position_call(torch.arange(500, 700), torch.arange(700),
                                                 sliding_padded_mask(200, 700)),
    "broadcast-mask": lambda: position_call(torch.arange(300), torch.arange(300),
                                            torch.rand(1, 1, 300, 300) > 0.3),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_mask_equals_the_elementwise_mask(case: str) -> None:
    call = BLOCK_CASES[case]()
    block_mask = flex_bias.flex_block_mask(call)
    batch, q_len, kv_len = call.query.shape[0], call.query.shape[2], call.key.shape[2]
    if call.attention_mask is not None:
        want = call.attention_mask[:, 0].expand(batch, -1, -1)
    else:
        query_pos, key_pos = call.query_pos.expand(batch, -1), call.key_pos.expand(batch, -1)
        want = key_pos[:, None, :] <= query_pos[:, :, None]
    assert torch.equal(dense_from_block_mask(block_mask, batch, q_len, kv_len), want)
    assert flex_bias.flex_block_mask(call) is block_mask  # memoised per forward


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
