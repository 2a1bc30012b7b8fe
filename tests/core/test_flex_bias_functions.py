"""Each bias scheme's flex score function, and the block masks compiled flex reads.

A scheme's elementwise ``flex_bias`` (evaluated on broadcast head, query, key and lane tensors) equals its dense
``forward()``, values and gradients, for prefill, a chunk after a cache, positions far from zero and per-row
positions, causal and bidirectional; T5's clamp past ``max_distance`` and FIRE's piecewise-linear form of its MLP
are checked exactly, and the lanes (which copy of a parameter a score reads) leave the output unchanged. The block
masks, which only compiled flex reads (uncompiled flex ignores the blocks), are checked block by block against the
elementwise mask.
"""

from __future__ import annotations

import flex_cases
import pytest
import torch

from hf_posswap.core import flex_bias
from hf_posswap.schemes.alibi import AlibiBias, alibi_slopes
from hf_posswap.schemes.base import FlexSpec, FusedCall
from hf_posswap.schemes.fire import FireBias
from hf_posswap.schemes.head_mix import HeadSelectedBias
from hf_posswap.schemes.kerple import KerpleBias, kerple_initial_values
from hf_posswap.schemes.sandwich import SandwichBias
from hf_posswap.schemes.t5 import T5RelativeBias

flex_on_cpu = flex_cases.flex_on_cpu  # the shared fixture (assigned: ruff reads an imported one as unused)


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
                  batch: int = 2, index_lag: int | None = None) -> FusedCall:
    q_len, kv_len = query_pos.shape[-1], key_pos.shape[-1]
    query, key = torch.zeros(batch, 2, q_len, 8), torch.zeros(batch, 2, kv_len, 8)
    return FusedCall(query, key, key, mask, query_pos, key_pos, 0, True, 1.0, 0.0, {}, index_lag=index_lag)


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
    "unordered-rows": lambda: position_call(shuffled_rows(333), shuffled_rows(333), index_lag=0),
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
    elif call.query_pos.dim() == 1:  # index positions: first position + index, so position order is token order
        want = (call.key_pos[None, :] <= call.query_pos[:, None]).expand(batch, -1, -1)
    else:  # per-row positions, in any order: causality still follows token order (index_lag)
        want = torch.ones(q_len, kv_len, dtype=torch.bool).tril(call.index_lag).expand(batch, -1, -1)
    assert torch.equal(dense_from_block_mask(block_mask, batch, q_len, kv_len), want)
    assert flex_bias.flex_block_mask(call) is block_mask  # memoised per forward
