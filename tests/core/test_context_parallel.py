"""Context parallelism (hf_posswap.core.context_parallel): a sequence split across ranks gives the logits and
gradients of one process.

Fast: the ring's algebra in one process (a sequence cut into shards, each query shard attending to every key shard,
merged by log-sum-exp) against the dense single-call attention, for a bias scheme, RoPE and Self-Extend, with index
positions and with given position ids; and the refusals. Slow: 2 and 3 gloo processes
(tests/core/context_parallel_worker.py) running tiny swapped models.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import MAX_POSITIONS, make_model, swapped
from process_launch import free_port, run_again_if_killed, wait_for_ranks

import hf_posswap as ps
from hf_posswap.core import context_parallel, ring_function
from hf_posswap.core.attention import eager_attention, scheme_inputs
from hf_posswap.core.context import PositionContext
from hf_posswap.core.context_parallel import RingGroup, RingShard, ring_attention, ring_plan
from hf_posswap.core.paths import record_paths
from hf_posswap.core.ring_math import KeyBlock, QueryBlock, block_logits, block_mask, block_partial, merge_partials
from hf_posswap.core.self_extend import chunked_self_extend, far_positions
from hf_posswap.schemes.base import ModelSpec
from hf_posswap.schemes.rope import apply_rotary
from hf_posswap.schemes.two_pass import TwoPassSettings

HEADS, KV_HEADS, DIM, LENGTH = 4, 2, 8, 23
SCALE = DIM**-0.5
SPEC = ModelSpec("llama", HEADS * DIM, 2, HEADS, KV_HEADS, DIM, True, 64, 0.02, 10_000.0, torch.float32,
                 torch.device("cpu"))


def qkv(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, HEADS, LENGTH, DIM, generator=generator)
    key = torch.randn(batch, KV_HEADS, LENGTH, DIM, generator=generator)
    return query, key, torch.randn(batch, KV_HEADS, LENGTH, DIM, generator=generator)


def dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
          allowed: torch.Tensor | None) -> torch.Tensor:
    """Single-call attention [B, H, L, D] with an additive bias and a bool mask."""
    groups = HEADS // KV_HEADS
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = query @ key.transpose(-1, -2) * SCALE + (0 if bias is None else bias)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return logits.softmax(-1) @ value


def shards(world: int) -> list[slice]:
    bounds = torch.linspace(0, LENGTH, world + 1).round().long().tolist()
    return [slice(bounds[r], bounds[r + 1]) for r in range(world)]


def ring(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world: int, causal: bool, bias_of=None,
         valid: torch.Tensor | None = None, settings: TwoPassSettings | None = None, far=None) -> torch.Tensor:
    """Every rank's output, as the ring computes them, concatenated [B, H, L, D] (far: (far q, far k))."""
    index = torch.arange(LENGTH)
    outputs = []
    for rank, rows in enumerate(shards(world)):
        queries = QueryBlock(query[:, :, rows], None if far is None else far[0][:, :, rows], index[rows], index[rows])
        partials = []
        for source, cols in enumerate(shards(world)):
            if causal and source > rank:  # wholly in the future: skipped, as the ring does
                continue
            block = KeyBlock(key[:, :, cols], None if far is None else far[1][:, :, cols], value[:, :, cols],
                             index[cols], index[cols], None if valid is None else valid[:, cols])
            bias = None if bias_of is None else bias_of(index[rows], index[cols])
            logits = block_logits(queries, block, SCALE, bias, settings, causal, torch.tensor([LENGTH - 1]))
            partials.append(block_partial(logits, block_mask(queries.index, block, causal), block.values))
        outputs.append(merge_partials(partials))
    return torch.cat(outputs, dim=2)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("scheme", ["alibi", "t5", "fire"])
def test_the_ring_of_a_bias_scheme_equals_one_call(scheme: str, causal: bool, world: int) -> None:
    configs = {"alibi": ps.AlibiConfig(), "t5": ps.T5BiasConfig(num_buckets=8, max_distance=16),
               "fire": ps.FireConfig()}
    module = configs[scheme].resolve(SPEC).build(SPEC)
    for parameter in module.parameters():  # zero-initialised tables and layers carry no signal
        if parameter.dim():
            torch.nn.init.normal_(parameter)
    query, key, value = qkv()
    valid = torch.ones(2, LENGTH, dtype=torch.bool)
    valid[1, :4] = False  # padding at the start of one row
    index = torch.arange(LENGTH)
    allowed = valid[:, None, None, :] & ((index[None, :] <= index[:, None]) if causal else True)
    expected = dense(query, key, value, module(index, index, 0, causal, None), allowed)
    output = ring(query, key, value, world, causal, lambda q, k: module(q, k, 0, causal, None), valid)
    torch.testing.assert_close(output[1, :, 4:], expected[1, :, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(output[0], expected[0], atol=1e-5, rtol=1e-5)


def test_the_ring_of_rope_rotates_by_global_positions() -> None:
    rotary = ps.RopeConfig().resolve(SPEC).build(SPEC)
    query, key, value = qkv()
    index = torch.arange(LENGTH)
    query, key = apply_rotary(query, *rotary(index)), apply_rotary(key, *rotary(index))
    expected = dense(query, key, value, None, index[None, :] <= index[:, None])
    torch.testing.assert_close(ring(query, key, value, 3, True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_the_ring_of_self_extend_equals_the_chunked_path(causal: bool) -> None:
    settings = TwoPassSettings(group=3, window=4, start=4)
    rotary = ps.RopeConfig().resolve(SPEC).build(SPEC)
    query, key, value = qkv()
    context = PositionContext(rotary, "rotary", 0, lambda module: True, two_pass=settings)
    module = torch.nn.Module()
    module.is_causal = causal
    expected, _ = chunked_self_extend(module, query, key, value, None, context, SCALE)  # [B, L, H, D]
    index = torch.arange(LENGTH)
    shift = settings.window - far_positions(settings.window, settings)
    far = (apply_rotary(query, *rotary(far_positions(index, settings) + shift)),
           apply_rotary(key, *rotary(far_positions(index, settings))))
    near_query, near_key = apply_rotary(query, *rotary(index)), apply_rotary(key, *rotary(index))
    output = ring(near_query, near_key, value, 3, causal, settings=settings, far=far)
    torch.testing.assert_close(output.transpose(1, 2), expected, atol=1e-5, rtol=1e-5)
    plain = ring(near_query, near_key, value, 3, causal)
    assert (plain - output).abs().max() > 1e-2  # grouping moved the logits: the check above can fail


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("scheme", ["t5", "xpos", "alibi", "self-extend"])
def test_one_rank_in_query_chunks_equals_the_dense_paths_with_gradients(
    monkeypatch: pytest.MonkeyPatch, scheme: str, causal: bool
) -> None:
    """The ring's autograd function on one rank (no communication): its forward and its own backward (dQ, dK, dV
    and the bias parameters' gradients) against the carrier's dense path, or the chunked Self-Extend path."""
    monkeypatch.setattr(context_parallel, "CHUNK_ELEMENTS", 2 * HEADS * LENGTH * 5)  # 5 query rows per chunk
    configs = {"t5": ps.T5BiasConfig(num_buckets=8, max_distance=16), "xpos": ps.XposConfig(),
               "alibi": ps.AlibiConfig()}
    config = configs.get(scheme, ps.RopeConfig())
    positions = config.resolve(SPEC).build(SPEC)
    for parameter in positions.parameters():
        torch.nn.init.normal_(parameter)
    settings = TwoPassSettings(3, 4, 4) if scheme == "self-extend" else None
    attention = torch.nn.Module()
    attention.is_causal, attention.layer_idx, attention.num_key_value_groups = causal, 0, HEADS // KV_HEADS
    inputs = [tensor.requires_grad_() for tensor in qkv()]
    weights = torch.randn(2, LENGTH, HEADS, DIM, generator=torch.Generator().manual_seed(3))

    def run(ring: bool) -> list[torch.Tensor]:
        context = PositionContext(positions, config.kind, 0, lambda module: True, two_pass=settings)
        if ring:
            shard = context_parallel.RingShard(None, 0, 1, (0,), (LENGTH,), None, None)
            output = ring_attention(attention, *inputs, context, shard, SCALE, 0.0)  # [B, L, H, D]
        elif settings is not None:
            output, _ = chunked_self_extend(attention, *inputs, None, context, SCALE)
        else:
            query, key, mask = scheme_inputs(attention, inputs[0], inputs[1], None, context)
            output, _ = eager_attention(attention, query, key, inputs[2], mask, SCALE)
        tensors = [*inputs, *(p for p in positions.parameters() if p.requires_grad)]
        return [output, *torch.autograd.grad((output * weights).sum(), tensors)]

    with record_paths() as paths:
        ring_results = run(True)
    assert paths == ["ring-fused" if scheme in ("xpos", "alibi") else "ring"]
    for got, want in zip(ring_results, run(False), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def given_positions() -> torch.Tensor:
    """Position ids [2, LENGTH]: row 0 PoSE-like (0..6, then a jump of 30), row 1 out of token order (so causality by
    position value would differ from causality by index), its first 4 tokens (padding in the tests) at 0."""
    positions = torch.arange(LENGTH).repeat(2, 1)
    positions[0, 7:] += 30
    positions[1] = torch.randperm(LENGTH, generator=torch.Generator().manual_seed(5)) * 2
    positions[1, :4] = 0
    return positions


def ring_of_parts(attention: torch.nn.Module, inputs: tuple, make_context, world: int, explicit: torch.Tensor | None,
                  valid: torch.Tensor) -> torch.Tensor:
    """Every rank's output [B, L, H, D] from the ring's own pieces in one process: each rank's plan
    (:func:`ring_plan`), each key block as its owner packs it and the receiving rank unpacks it (positions and all),
    the block forward of the plan's path, merged by log-sum-exp."""
    query, key, value = inputs
    bounds = shards(world)
    starts, lengths = tuple(b.start for b in bounds), tuple(b.stop - b.start for b in bounds)
    padded = (valid.long().cumsum(-1) - 1).clamp(min=0)

    def plan_of(rank: int) -> tuple:
        shard = RingShard(None, rank, world, starts, lengths, valid, padded, explicit)
        rows = bounds[rank]
        return ring_plan(attention, query[:, :, rows], key[:, :, rows], value[:, :, rows], make_context(), shard, SCALE)

    outputs = []
    for rank in range(world):
        queries, _, plan = plan_of(rank)
        partials = []
        for source in range(world):
            if plan.causal and source > rank:  # wholly in the future (by token order): skipped, as the ring does
                continue
            block = ring_function._unpack(context_parallel._pack(plan_of(source)[1]), plan, source)
            forward = ring_function._fused_forward_block if plan.fused else ring_function._forward_block
            partials.append(forward(queries, block, plan, source))
        outputs.append(merge_partials(partials))
    return torch.cat(outputs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("scheme", ["alibi", "t5", "xpos", "self-extend"])
def test_the_ring_uses_given_position_ids_as_one_process_does(scheme: str, causal: bool, world: int) -> None:
    """The ring's pieces given the whole sequence's position ids (each rank its slice) against one call given them
    (the carrier's dense path, or chunked Self-Extend), with a mask by token order and padding in one row."""
    configs = {"t5": ps.T5BiasConfig(num_buckets=8, max_distance=16), "xpos": ps.XposConfig(),
               "alibi": ps.AlibiConfig()}
    config = configs.get(scheme, ps.RopeConfig())
    positions = config.resolve(SPEC).build(SPEC)
    for parameter in positions.parameters():
        if parameter.dim():
            torch.nn.init.normal_(parameter)
    settings = TwoPassSettings(3, 4, 4) if scheme == "self-extend" else None
    attention = torch.nn.Module()
    attention.is_causal, attention.layer_idx, attention.num_key_value_groups = causal, 0, HEADS // KV_HEADS
    explicit = given_positions()
    valid = torch.ones(2, LENGTH, dtype=torch.bool)
    valid[1, :4] = False

    def make_context() -> PositionContext:
        return PositionContext(positions, config.kind, 0, lambda module: True, two_pass=settings)

    query, key, value = qkv()
    index = torch.arange(LENGTH)
    allowed = valid[:, None, None, :] & ((index[None, :] <= index[:, None]) if causal else True)  # [B, 1, L, L]
    context = make_context()
    context.row_positions = explicit
    if settings is not None:
        expected, _ = chunked_self_extend(attention, query, key, value, allowed, context, SCALE)
    else:
        query_in, key_in, mask = scheme_inputs(attention, query, key, allowed, context)
        expected, _ = eager_attention(attention, query_in, key_in, value, mask, SCALE)
    output = ring_of_parts(attention, (query, key, value), make_context, world, explicit, valid)
    torch.testing.assert_close(output[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(output[1, 4:], expected[1, 4:], atol=1e-5, rtol=1e-5)
    by_index = ring_of_parts(attention, (query, key, value), make_context, world, None, valid)
    assert (by_index - output)[0].abs().max() > 1e-2  # the position ids moved the output: the check above can fail


def test_position_ids_on_some_ranks_only_are_refused() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"passed on ranks \[0\] but not on ranks \[1\]"):
        context_parallel._whole_position_ids([torch.zeros(1, 3, dtype=torch.long), None], torch.device("cpu"))


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_gapped_position_ids_without_a_mask_are_refused_in_a_causal_model(
    monkeypatch: pytest.MonkeyPatch, masked: bool
) -> None:
    """transformers reads position ids with a gap and no attention_mask as packed sequences (a causal mask within
    each); the ring would attend across the gap, so it refuses, and takes them with a mask (PoSE)."""
    monkeypatch.setattr(context_parallel.dist, "get_world_size", lambda group: 1)
    monkeypatch.setattr(context_parallel.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(context_parallel, "_all_gather_object", lambda item, world, group: [item])
    positions = torch.cat((torch.arange(4), torch.arange(10, 14)))[None]  # [1, 8]: a jump of 7
    kwargs = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": positions}
    if masked:
        kwargs["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    shard = RingGroup(group=object()).prepare(kwargs, None)
    assert torch.equal(shard.explicit, positions.expand(2, 8))
    attention = torch.nn.Module()
    attention.is_causal = True
    query, key, value = (tensor[..., :8, :] for tensor in qkv())
    context = PositionContext(ps.AlibiConfig().resolve(SPEC).build(SPEC), "bias", 0, lambda module: True)
    if masked:
        ring_plan(attention, query, key, value, context, shard, SCALE)
        return
    with pytest.raises(ps.InvalidConfigError, match="packed sequences"):
        ring_plan(attention, query, key, value, context, shard, SCALE)
    attention.is_causal = False  # bidirectional models build no packed-sequence mask
    ring_plan(attention, query, key, value, context, shard, SCALE)


@pytest.mark.parametrize(("other_rows", "other_length", "refusal"),
                         [(2, 0, r"holds no token \(shard lengths \[8, 0\]\)"),
                          (1, 8, r"batches of \[2, 1\] rows")], ids=["empty-shard", "other-batch"])
def test_shards_of_other_rows_or_of_no_token_are_refused_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, other_rows: int, other_length: int, refusal: str
) -> None:
    """Every rank reads the same gathered shapes, so every rank raises the same error (rather than one failing
    inside the model and the other on the lost connection)."""
    monkeypatch.setattr(context_parallel.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(context_parallel.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(context_parallel, "_all_gather_object",
                        lambda item, world, group: [item, (other_length, None, None, other_rows, item[4])])
    with pytest.raises(ps.InvalidConfigError, match=refusal):
        RingGroup(group=object()).prepare({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, None)


@pytest.mark.parametrize(("here", "there", "named"),
                         [(("llama", "alibi"), ("llama", "t5"),
                           r"rank 0: alibi \(trainable_slopes=False\); rank 1: t5 \(max_distance=32, "),
                          (("bert", "alibi"), ("bert", "alibi", 2 * MAX_POSITIONS),
                           r"rank 0: alibi \(trainable_slopes=False\); rank 1: .*extended by 'lift' to 128")],
                         ids=["other-scheme", "other-extension"])
def test_ranks_holding_models_swapped_differently_are_refused_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, here: tuple, there: tuple, named: str
) -> None:
    """A rank swapped to another scheme (or extended otherwise) would attend its shard with other positions than the
    rest of the ring and no error; every rank reads the same gathered signatures, so every rank refuses."""
    models = [swapped(*spec[:2]) for spec in (here, there)]
    for model, spec in zip(models, (here, there), strict=True):
        if len(spec) == 3:
            ps.extend_context(model, spec[2], "lift")
    other = context_parallel.swap_signature(models[1])
    monkeypatch.setattr(context_parallel.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(context_parallel.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(context_parallel, "_all_gather_object", lambda item, world, group: [item, (*item[:4], other)])
    with ps.context_parallel(models[0], group=object()):
        with pytest.raises(ps.InvalidConfigError, match=named):
            models[0](input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
    monkeypatch.setattr(context_parallel, "_all_gather_object", lambda item, world, group: [item, item])
    mine = context_parallel.swap_signature(models[0])  # the same swap on both ranks goes on
    RingGroup(object(), mine).prepare({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, None)


def test_a_model_without_a_position_hook_is_refused() -> None:
    with pytest.raises(ps.InvalidConfigError, match="no hf_posswap position wrapper"):
        with ps.context_parallel(make_model("llama")):
            pass


@pytest.mark.parametrize("scheme", ["sinusoidal", "none"])
def test_a_scheme_with_nothing_in_attention_is_refused(scheme: str) -> None:
    """transformers' own attention would attend within each rank's shard only (seen: rank 1's logits off by 0.6)."""
    with pytest.raises(ps.InvalidConfigError, match=f"kind '{'absolute' if scheme == 'sinusoidal' else 'none'}'"):
        with ps.context_parallel(swapped("gpt2", scheme), group=object()):
            pass


def test_a_kv_cache_is_refused() -> None:
    with pytest.raises(ps.InvalidConfigError, match="use_cache=False"):
        RingGroup(group=object()).prepare({"input_ids": torch.zeros(1, 4, dtype=torch.long), "use_cache": True}, None)


def test_an_unhandled_scheme_kind_is_named() -> None:
    context = PositionContext(None, "mystery", 0, lambda module: True)
    query, key, value = qkv()
    with pytest.raises(ps.InvalidConfigError, match="kind 'mystery'"):
        ring_attention(torch.nn.Module(), query, key, value, context, None, None, 0.0)


def test_the_hook_is_removed_after_the_block() -> None:
    model = swapped("bert", "alibi")
    with ps.context_parallel(model, group=object()):
        assert model.base_model.forward.inputs.ring is not None
    assert model.base_model.forward.inputs.ring is None


# ---- several processes ------------------------------------------------------------------------------------------

WORKER = Path(__file__).with_name("context_parallel_worker.py")
#: (case, padded): every scheme kind in a causal (LLaMA, grouped-query) and a bidirectional (BERT) model
TWO_RANKS = [
    ("llama-xpos", True), ("bert-rope", True), ("llama-alibi", True), ("bert-alibi", True), ("llama-t5", True),
    ("bert-t5", True), ("llama-kerple", True), ("bert-kerple", False), ("llama-fire", True), ("bert-fire", True),
    ("llama-layer-mix", True), ("bert-layer-mix", True), ("llama-irope", True), ("llama-self-extend", False),
    ("llama-self-extend", True), ("bert-self-extend", True), ("llama-checkpointed-t5", True),
]
#: uneven shards (14, 13, 13 tokens)
THREE_RANKS = [("gpt2-alibi", True), ("llama-t5", True), ("bert-fire", False), ("llama-layer-mix", False),
               ("llama-self-extend", True)]

#: PoSE-like position ids (each row 0..k, then a jump), every rank passing its shard's slice of them
GIVEN_POSITIONS = [
    [case, padded, "gapped"] for case, padded in [
        ("llama-xpos", False), ("bert-rope", True), ("llama-alibi", True), ("bert-alibi", False), ("llama-t5", False),
        ("bert-t5", True), ("llama-kerple", False), ("bert-kerple", True), ("llama-fire", True), ("bert-fire", False),
        ("llama-layer-mix", False), ("bert-layer-mix", True), ("llama-irope", True), ("llama-self-extend", False),
        ("llama-self-extend", True), ("bert-self-extend", False),
    ]
]


def expected_paths(case: str) -> list[str]:
    """Blocks as matmuls where a bias parameter needs a gradient or Self-Extend runs, else the CPU flash kernel."""
    if case.endswith("layer-mix"):  # a T5 layer, and a head mix of fixed ALiBi slopes and RoPE
        return ["ring", "ring-fused"]
    dense = ("t5", "kerple", "fire", "self-extend")
    return ["ring"] if case.endswith(dense) else ["ring-fused"]


def run_ranks(world: int, cases: list) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    commands = [[sys.executable, str(WORKER), str(rank), str(world), json.dumps(cases)] for rank in range(world)]
    results = [json.loads(line) for out in wait_for_ranks(commands, env) for line in out.splitlines()
               if line.startswith("{")]
    assert len(results) == world * len(cases)
    return results


@pytest.mark.slow
def test_ranks_swapped_to_different_schemes_refuse_together(tmp_path: Path) -> None:
    """Rank 0 holds ALiBi and rank 1 T5: both raise the same error instead of running the ring."""
    results = run_again_if_killed(lambda _: run_ranks(2, [["other-swaps", False]]), tmp_path)
    refusals = [result["refused"] for result in sorted(results, key=lambda result: result["rank"])]
    assert all(refusal is not None and "swapped differently" in refusal for refusal in refusals), refusals
    assert refusals[0] == refusals[1]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "cases"), [(2, TWO_RANKS), (3, THREE_RANKS), (2, GIVEN_POSITIONS)],
                         ids=["two-ranks", "three-ranks", "two-ranks-given-position-ids"])
def test_split_sequences_give_the_logits_and_gradients_of_one_process(world: int, cases: list,
                                                                      tmp_path: Path) -> None:
    failed = [
        result for result in run_again_if_killed(lambda _: run_ranks(world, cases), tmp_path)
        if result["logits"] > 1e-5 or max(result["grads"]) > 1e-5 or result["paths"] != expected_paths(result["case"])
    ]
    assert not failed, json.dumps(failed, indent=1)
