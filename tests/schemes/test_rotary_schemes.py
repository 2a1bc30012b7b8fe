"""xPos and proportional RoPE (p-RoPE) against code nobody here wrote, plus what the family x scheme matrix cannot
show: xPos refuses encoders, stays finite at long positions, scales cached keys once; p-RoPE is native in LLaMA and
reloads in vanilla transformers, and its layout is not partial RoPE's.

Peers:
- xPos: microsoft/torchscale ``torchscale/component/xpos_relative_position.py`` (class ``XPOS``) and
  lucidrains/x-transformers ``x_transformers/x_transformers.py`` (``RotaryEmbedding(use_xpos=True)``,
  ``apply_rotary_pos_emb``; the attention applies ``scale`` to q and ``scale ** -1`` to k). Both pair neighbouring
  dims (2i, 2i + 1); hf_posswap pairs i with i + d/2, so the test permutes q and k before comparing logits.
- p-RoPE: transformers' ``ROPE_INIT_FUNCTIONS["proportional"]`` and ``LlamaRotaryEmbedding``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo
from conftest import CAUSAL_FAMILIES, FAMILIES, MAX_POSITIONS, VOCAB, make_model, swapped
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import hf_posswap as ps
from hf_posswap.core import rotary_cache
from hf_posswap.errors import InvalidConfigError
from hf_posswap.schemes import ProportionalRopeConfig, XposConfig, XposEmbedding, apply_rotary
from hf_posswap.schemes.xpos import xpos_max_span

ENCODERS = [f for f in FAMILIES if f not in CAUSAL_FAMILIES]


def tokens(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] from the peers' neighbour pairing (2i, 2i+1) to HF's rotate-half pairing (i, i + d/2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def xpos_logits(q: torch.Tensor, k: torch.Tensor, scale_base: float, reference: int = 0, offset: int = 0):
    """q·k^T [L, L] with hf_posswap's xPos (q, k [L, d] in rotate-half layout, positions offset .. offset + L - 1)."""
    module = XposEmbedding(10_000.0, q.shape[-1], scale_base).double()
    positions = torch.arange(q.shape[0]) + offset
    rotated_q = apply_rotary(q[None, None].double(), *module(positions, reference=reference))[0, 0]
    rotated_k = apply_rotary(k[None, None].double(), *module(positions, keys=True, reference=reference))[0, 0]
    return rotated_q @ rotated_k.T


def torchscale_xpos_logits(q: torch.Tensor, k: torch.Tensor, scale_base: float) -> torch.Tensor:
    """The logits of torchscale's XPOS (torchscale/component/xpos_relative_position.py), written out from its code:
    scale = (arange(0, d, 2) + 0.4 d) / (1.4 d) raised to positions centred at -(L // 2) over scale_base; the
    rotation's angles come from fixed_pos_embedding (10000^(-j / (d/2)) times 0 .. L-1), interleaved pairs;
    queries with scale, keys with 1 / scale (downscale=True)."""
    length, dim = q.shape
    scale = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    min_pos = -length // 2
    scale = scale ** (torch.arange(min_pos, length + min_pos, dtype=torch.float64) / scale_base)[:, None]  # [L, d/2]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim // 2, dtype=torch.float64) / (dim // 2)))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq  # [L, d/2]
    sin, cos = angles.sin(), angles.cos()

    def rotate_every_two(x):
        return torch.stack((-x[:, 1::2], x[:, 0::2]), dim=-1).flatten(-2)

    def apply(x, factor):
        s, c = (torch.repeat_interleave(t * factor, 2, dim=-1) for t in (sin, cos))
        return x * c + rotate_every_two(x) * s

    return apply(q.double(), scale) @ apply(k.double(), 1 / scale).T


def x_transformers_xpos_logits(q: torch.Tensor, k: torch.Tensor, scale_base: float) -> torch.Tensor:
    """The logits of x-transformers' RotaryEmbedding(use_xpos=True) + apply_rotary_pos_emb, written out from its
    code: power = (t - max_pos // 2) / scale_base, scale = zeta ** power; q gets scale, k gets scale ** -1."""
    length, dim = q.shape
    t = torch.arange(length, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.repeat_interleave(t[:, None] * inv_freq, 2, dim=-1)  # '(d r)' with r = 2
    zeta = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    power = (t - (length // 2)) / scale_base
    scale = torch.repeat_interleave(zeta ** power[:, None], 2, dim=-1)

    def rotate_half(x):  # x-transformers' rotate_half pairs neighbours
        return torch.stack((-x[:, 1::2], x[:, 0::2]), dim=-1).flatten(-2)

    def apply(x, factor):
        return x * freqs.cos() * factor + rotate_half(x) * freqs.sin() * factor

    return apply(q.double(), scale) @ apply(k.double(), scale ** -1.0).T


@pytest.mark.parametrize("peer", ["torchscale", "x-transformers"])
@pytest.mark.parametrize("scale_base", [8.0, 512.0])
def test_xpos_logits_equal_the_peers(peer: str, scale_base: float) -> None:
    """Fixed q, k (peer layout) -> the same causal logits (key at or before the query) as the peer's formula. Computed
    in float64 from hf_posswap's float32 buffers (inv_freq, zeta), whose rounding (~6e-8) bounds the agreement."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(48, 32, generator=generator), torch.randn(48, 32, generator=generator)
    theirs = (torchscale_xpos_logits if peer == "torchscale" else x_transformers_xpos_logits)(q, k, scale_base)
    ours = xpos_logits(interleaved_to_half(q), interleaved_to_half(k), scale_base, reference=0)
    causal = torch.ones(48, 48, dtype=torch.bool).tril()
    torch.testing.assert_close(ours[causal], theirs[causal], atol=1e-5, rtol=1e-5)
    # the decay is seen: plain RoPE's logits differ by more than rounding at scale_base 8
    plain = xpos_logits(interleaved_to_half(q), interleaved_to_half(k), 1e12)  # factors 1 to 1e-12
    assert (ours - plain)[causal].abs().max() > (1e-3 if scale_base == 512.0 else 1.0)


def test_xpos_logits_depend_on_the_distance_only() -> None:
    """Any reference and any shift of all positions give the same logits (queries and keys share the reference)."""
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(32, 16, generator=generator), torch.randn(32, 16, generator=generator)
    base = xpos_logits(q, k, 16.0)
    torch.testing.assert_close(xpos_logits(q, k, 16.0, reference=50, offset=100), base, atol=1e-9, rtol=1e-9)


def test_xpos_stays_finite_at_8k_positions() -> None:
    """At 8,192 positions the factors, counted from position 0 (the worst reference: 2e-9 and 5e8) or from the centre,
    are finite and non-zero in float32, both give the same float32 logits, and their error against float64 is
    no larger than plain RoPE's own float32 error there (the angles n * inv_freq lose ~5e-4 rad at 8k)."""
    positions = torch.arange(8192)
    generator = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 92, 64, generator=generator), torch.randn(1, 1, 8192, 64, generator=generator)

    def logits(scale_base: float, dtype: torch.dtype, reference: int) -> torch.Tensor:
        module = XposEmbedding(10_000.0, 64, scale_base).to(dtype)
        query_cos, query_sin = module(positions[8100:], reference=reference)
        key_cos, key_sin = module(positions, keys=True, reference=reference)
        for tensor in (query_cos, query_sin, key_cos, key_sin):
            assert torch.isfinite(tensor).all()
        for cos, sin in ((query_cos, query_sin), (key_cos, key_sin)):
            assert bool(((cos.abs() + sin.abs()) > 0).all())
        rotated_q = apply_rotary(q.to(dtype), query_cos, query_sin)
        return (rotated_q @ apply_rotary(k.to(dtype), key_cos, key_sin).transpose(-1, -2)).double()

    from_zero, centred = logits(512.0, torch.float32, 0), logits(512.0, torch.float32, 4096)
    assert torch.isfinite(from_zero).all() and torch.isfinite(centred).all()
    torch.testing.assert_close(from_zero, centred, atol=1e-4, rtol=1e-4)
    xpos_error = (centred - logits(512.0, torch.float64, 4096)).abs().max()
    rope_error = (logits(1e12, torch.float32, 4096) - logits(1e12, torch.float64, 4096)).abs().max()
    assert xpos_error <= 1.5 * rope_error, (xpos_error, rope_error)


def test_xpos_refuses_a_span_past_float32s_range() -> None:
    module = XposEmbedding(10_000.0, 64, 16.0)
    span = xpos_max_span(64, 16.0)
    for keys in (False, True):  # exactly the limit: allowed, and every factor finite and non-zero in float32
        cos, sin = module(torch.arange(span + 1), keys=keys)
        assert torch.isfinite(cos).all() and bool(((cos.abs() + sin.abs()) > 0).all())
        assert torch.isfinite(cos * 1e3).all() and torch.isfinite(sin * 1e3).all()  # headroom for |k| up to 1e3
    with pytest.raises(InvalidConfigError, match=r"xPos with scale_base=16 .* swap with XposConfig\(scale_base>="):
        module(torch.arange(span + 2))


def test_compiled_xpos_checks_its_span_inside_the_graph() -> None:
    """Compiled (one graph: no host read of the positions), the limit is the eager one and a longer span is still
    refused, with the fix named."""
    module = XposEmbedding(10_000.0, 64, 16.0)
    span = xpos_max_span(64, 16.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda positions: module(positions, keys=True), backend="eager", fullgraph=True)
    try:
        torch.testing.assert_close(compiled(torch.arange(span + 1)), module(torch.arange(span + 1), keys=True))
        with pytest.raises(RuntimeError, match=rf"more than {span} tokens from the reference.*XposConfig\(scale_base"):
            compiled(torch.arange(span + 2))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("scale_base", [1e-6, 0.01])
def test_xpos_refuses_a_scale_base_no_input_could_run_with(scale_base: float) -> None:
    """Refused at swap time, naming a scale_base that fits the model's length; the one suggested swaps and runs
    that length."""
    model = make_model("llama")
    with pytest.raises(InvalidConfigError, match=rf"scale_base={scale_base!r} .* Use scale_base >= (\d+) "):
        ps.swap(model, "xpos", scale_base=scale_base)
    with pytest.raises(InvalidConfigError) as refused:
        ps.swap(model, "xpos", scale_base=scale_base)
    suggested = int(re.search(r"scale_base >= (\d+)", str(refused.value)).group(1))
    ps.swap(model, "xpos", scale_base=float(suggested))
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, VOCAB, (1, MAX_POSITIONS))).logits).all()


def test_xpos_in_float16_keeps_its_factors_finite() -> None:
    """A float16 model (the module follows model.half()) gets float16's range: 2^±14, a shorter span than float32's."""
    module = XposEmbedding(10_000.0, 64, 512.0).half()
    span = xpos_max_span(64, 512.0, torch.float16)
    assert span == module.max_span and 3900 < span < xpos_max_span(64, 512.0) / 7
    for keys in (False, True):
        cos, sin = (t.half() for t in module(torch.arange(-span, span + 1), keys=keys))
        assert torch.isfinite(cos * 3).all() and torch.isfinite(sin * 3).all()
        assert bool(((cos.abs() + sin.abs()) > 0).all())
    with pytest.raises(InvalidConfigError, match=r"beyond what float16 keeps finite"):
        module(torch.arange(span + 2))
    model = swapped("gpt2", "xpos").half()
    assert model.base_model.posswap_positions.max_span == span


@pytest.mark.parametrize("family", ENCODERS)
def test_xpos_refuses_encoders_before_any_edit(family: str) -> None:
    """The matrix skips (encoder, xpos); here the refusal: clear, eager, and the model untouched."""
    model = make_model(family)
    before = model.config.to_dict()
    with pytest.raises(InvalidConfigError, match=r"xPos is for causal attention only.*bidirectional.*'rope'"):
        ps.swap(model, "xpos")
    assert model.config.to_dict() == before and not hasattr(model, "_posswap_state")
    assert "forward" not in vars(model.base_model)


def test_xpos_accepts_bert_as_a_decoder() -> None:
    from test_rotary_decode import bert_decoder

    model = ps.swap(bert_decoder(), "xpos")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=tokens(1, 12)).logits).all()


def test_xpos_scales_cached_keys_once_from_a_recorded_reference() -> None:
    """A prefill stores keys rotated and scaled with the reference it chose (the centre); a decode step keeps it,
    scales only the new key, and gives the logits of a full recompute."""
    model = swapped("gpt2", "xpos")
    model.base_model.posswap_positions.scale_base = 4.0  # a strong decay, so a wrong factor shows
    input_ids = tokens(1, 21)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=input_ids[:, :20], past_key_values=cache)
        marker = getattr(cache.layers[0], rotary_cache.MARKER)
        assert (marker.count, marker.reference) == (20, 10)
        step = model(input_ids=input_ids[:, 20:], past_key_values=cache).logits[0, -1]
        assert getattr(cache.layers[0], rotary_cache.MARKER).reference == 10
        full = model(input_ids=input_ids).logits[0, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-4)


DECODING = {
    "greedy": {"do_sample": False},
    "beams": {"num_beams": 3, "do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 1.0},
    "static": {"do_sample": False, "cache_implementation": "static"},
}


@pytest.mark.slow
@pytest.mark.parametrize("decoding", list(DECODING))
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_xpos_cached_generation_equals_full_recompute_in_a_padded_batch(family: str, decoding: str) -> None:
    from test_rotary_decode import assert_same_generation, generation, padded_batch

    model = swapped(family, "xpos")
    model.base_model.posswap_positions.scale_base = 8.0
    input_ids, mask = padded_batch(20)
    with torch.no_grad():
        assert_same_generation(generation(model, input_ids, mask, True, **DECODING[decoding]),
                               generation(model, input_ids, mask, False, **DECODING[decoding]))


@pytest.mark.slow
def test_xpos_model_at_8k_tokens_is_finite_and_decodes_exactly() -> None:
    """A GPT-2 swapped to xPos (scale_base 512) runs 8,192 tokens finite; one cached step after them equals the
    full recompute."""
    model = swapped("gpt2", "xpos")
    input_ids = tokens(1, 8193)
    cache = DynamicCache()
    with torch.no_grad():
        prefill = model(input_ids=input_ids[:, :8192], past_key_values=cache).logits
        step = model(input_ids=input_ids[:, 8192:], past_key_values=cache).logits[0, -1]
        full = model(input_ids=input_ids).logits[0, -1]
    assert torch.isfinite(prefill).all() and torch.isfinite(full).all()
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


def test_xpos_with_explicit_position_ids() -> None:
    """Position ids (PoSE) reach xPos: a constant shift changes nothing, a skip changes the logits."""
    model = swapped("gpt2", "xpos")
    model.base_model.posswap_positions.scale_base = 8.0
    input_ids = tokens(2, 16)
    arange = torch.arange(16)[None].expand(2, -1)
    skipped = torch.cat([torch.arange(8), torch.arange(8) + 40])[None].expand(2, -1)
    with torch.no_grad():
        default = model(input_ids=input_ids).logits
        torch.testing.assert_close(model(input_ids=input_ids, position_ids=arange + 5).logits, default,
                                   atol=1e-5, rtol=1e-4)
        skip = model(input_ids=input_ids, position_ids=skipped).logits
    assert (skip - default).abs().max() > 1e-5  # the skip is seen (tiny random model: small effect)


# --- proportional RoPE --------------------------------------------------------------------------------------------


def llama_view(head_dim: int, rope_parameters: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       rope_parameters=dict(rope_parameters), max_position_embeddings=64)


def scheme_module(config: ps.SchemeConfig, family: str = "gpt2") -> torch.nn.Module:
    model = make_model(family)
    ps.swap(model, config)
    return model.base_model.posswap_positions


@pytest.mark.parametrize("factor", [0.25, 0.5, 0.75, 1.0])
def test_proportional_frequencies_and_cos_sin_equal_transformers(factor: float) -> None:
    """inv_freq of the in-attention module = ROPE_INIT_FUNCTIONS['proportional']; cos/sin = LlamaRotaryEmbedding's
    for the same rope_parameters (head_dim 16: GPT-2's tiny heads)."""
    rope_parameters = {"rope_type": "proportional", "rope_theta": 10_000.0, "partial_rotary_factor": factor}
    module = scheme_module(ProportionalRopeConfig(partial_rotary_factor=factor))
    expected, scaling = ROPE_INIT_FUNCTIONS["proportional"](llama_view(16, rope_parameters), None)
    assert torch.equal(module.inv_freq, expected) and scaling == 1.0
    positions = torch.arange(40)
    cos, sin = module(positions)
    theirs = LlamaRotaryEmbedding(llama_view(16, rope_parameters))
    their_cos, their_sin = theirs(torch.ones(1, dtype=torch.float32), positions[None])
    assert torch.equal(cos, their_cos[0]) and torch.equal(sin, their_sin[0])


def test_proportional_layout_is_not_partial_ropes() -> None:
    """p = 0.5 of a 16-dim head. p-RoPE: pairs (i, i + 8) rotate for i < 4 with theta^(-2i/16); dims 4-7 and 12-15
    stay (cos 1, sin 0). Partial RoPE: dims 0-7 rotate as pairs (i, i + 4) with theta^(-2i/8); dims 8-15 stay."""
    positions = torch.arange(1, 30)
    cos, sin = scheme_module(ProportionalRopeConfig(partial_rotary_factor=0.5))(positions)
    still = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    moving = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
    assert cos.shape[-1] == 16
    assert torch.equal(cos[:, still], torch.ones(29, 8)) and torch.equal(sin[:, still], torch.zeros(29, 8))
    assert bool((sin[:, moving].abs() > 0).any(0).all())
    p_inv_freq = scheme_module(ProportionalRopeConfig(partial_rotary_factor=0.5)).inv_freq
    torch.testing.assert_close(p_inv_freq[:4], 10_000.0 ** (-torch.arange(0, 8, 2) / 16))

    partial = scheme_module(ps.RopeConfig(partial_rotary_factor=0.5))
    partial_cos, _ = partial(positions)
    assert partial.rotary_dim == 8 and partial_cos.shape[-1] == 8  # dims 8-15 pass through apply_rotary
    view = llama_view(16, {"rope_type": "linear", "factor": 1.0, "rope_theta": 10_000.0, "partial_rotary_factor": 0.5})
    partial_expected, _ = ROPE_INIT_FUNCTIONS["linear"](view, None)
    torch.testing.assert_close(partial.inv_freq, partial_expected)
    torch.testing.assert_close(partial.inv_freq, 10_000.0 ** (-torch.arange(0, 8, 2) / 8))
    assert not torch.allclose(partial.inv_freq, p_inv_freq[:4])
    x = torch.randn(1, 1, 29, 16)
    assert not torch.allclose(apply_rotary(x, *partial(positions)), apply_rotary(x, cos, sin))


def test_proportional_is_native_in_llama_and_equals_vanilla_transformers(tmp_path: Path) -> None:
    """LLaMA carries p-RoPE in config.rope_parameters with its own LlamaRotaryEmbedding; a vanilla
    LlamaForCausalLM built from the saved directory gives the same logits (bit for bit)."""
    model = make_model("llama")
    ps.swap(model, ProportionalRopeConfig(partial_rotary_factor=0.5))
    assert ps.describe(model).native
    assert model.config.rope_parameters == {"rope_type": "proportional", "rope_theta": 10_000.0,
                                            "partial_rotary_factor": 0.5}
    assert type(model.model.rotary_emb) is LlamaRotaryEmbedding
    model.save_pretrained(tmp_path)
    vanilla = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert vanilla.config.rope_parameters["rope_type"] == "proportional"
    input_ids = tokens(2, 30)
    with torch.no_grad():
        assert torch.equal(vanilla(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
        unswapped = ps.unswap(model)(input_ids=input_ids).logits
    assert (unswapped - vanilla(input_ids=input_ids).logits).abs().max() > 1e-4  # p-RoPE is seen


@pytest.mark.slow
def test_proportional_checkpoint_loads_where_hf_posswap_cannot_be_imported(tmp_path: Path) -> None:
    model = make_model("llama")
    ps.swap(model, "proportional")
    model.save_pretrained(tmp_path)
    input_ids = tokens(1, 40)
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "expected": model(input_ids=input_ids).logits}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_posswap"] = None
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "io.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
        with torch.no_grad():
            gap = (model(input_ids=data["input_ids"]).logits - data["expected"]).abs().max().item()
        print(type(model.model.rotary_emb).__name__, model.config.rope_parameters["rope_type"], gap)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    name, rope_type, gap = result.stdout.split()
    assert (name, rope_type) == ("LlamaRotaryEmbedding", "proportional") and float(gap) <= 1e-5


def test_proportional_settings_are_checked_before_any_edit() -> None:
    model = make_model("llama")
    with pytest.raises(InvalidConfigError, match=r"partial_rotary_factor=0.05 rotates 0 of 8 frequency pairs"):
        ps.swap(model, ProportionalRopeConfig(partial_rotary_factor=0.05))
    assert not hasattr(model, "_posswap_state") and model.config.rope_parameters["rope_type"] == "default"
    with pytest.raises(InvalidConfigError, match=r"ProportionalRopeConfig.scaling must be None"):
        ProportionalRopeConfig(scaling=ps.YarnScaling(factor=2.0))
    with pytest.raises(InvalidConfigError, match=r"ProportionalRopeConfig.scaling must be None"):
        ps.extend_context(ps.swap(make_model("gpt2"), "proportional"), 128)


def test_xpos_config_values_are_checked() -> None:
    with pytest.raises(InvalidConfigError, match=r"XposConfig.scale_base must be a positive finite number"):
        XposConfig(scale_base=0)
    with pytest.raises(InvalidConfigError, match=r"XposConfig.rope_theta must be above 1"):
        XposConfig(rope_theta=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["xpos", "proportional"])
def test_standalone_export_loads_without_hf_posswap(tmp_path: Path, scheme: str) -> None:
    """export_standalone bundles both scheme modules: GPT-2 (in attention) reloads where hf_posswap is absent."""
    from test_export import load_without_hf_posswap

    model = swapped("gpt2", scheme)
    input_ids = tokens(1, 100)
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "expected": model(input_ids=input_ids).logits}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", "AutoModelForCausalLM")


ROTATIONS_INSIDE_ATTENTION = [("gpt2", "rope"), ("gpt2", "xpos"), ("gpt2", "proportional"), ("llama", "xpos"),
                              ("llama", "layer_mix")]


def assert_exact_angles(model: torch.nn.Module, scheme: str) -> None:
    """The angles at position 8,191 equal RoFormer's (eq. 15, in float64) to float32's rounding; frequencies rounded
    to 8 bits put them whole radians off."""
    rotation = model.base_model.posswap_positions
    rotation = rotation(0) if scheme == "layer_mix" else rotation  # the mix's RoPE part (layer 0)
    centred = {"reference": 8191} if scheme == "xpos" else {}  # xPos's factor 1 there, so float16 holds it
    cos, sin = rotation(torch.tensor([8191]), **centred)  # [1, rotary_dim] each
    half = rotation.rotary_dim // 2
    exact = 8191 * 10_000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / rotation.rotary_dim)
    angle = torch.atan2(sin[0, :half].double(), cos[0, :half].double())  # xPos scales cos and sin alike
    wrapped = torch.remainder(angle - exact + torch.pi, 2 * torch.pi) - torch.pi
    assert wrapped.abs().max() < 5e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("family", "scheme"), ROTATIONS_INSIDE_ATTENTION,
                         ids=[f"{f}-{s}" for f, s in ROTATIONS_INSIDE_ATTENTION])
def test_a_cast_after_the_swap_keeps_the_frequencies_exact(family: str, scheme: str, dtype: torch.dtype,
                                                           tmp_path: Path) -> None:
    """``model.to(torch.bfloat16)`` after the swap rounded the rotation's frequencies (and xPos's decay rates) to 8
    bits, so the angle of position p moved by p times the rounding (1.46 rad at 8,191), while the same cast before
    the swap kept them in float32; a checkpoint saved from the cast model, or a cast back to float32, kept the
    rounded values. Every order now rotates by the exact float32 frequencies."""
    from conftest import scheme_config

    def model(cast_first: bool) -> torch.nn.Module:
        built = make_model(family).eval()
        if cast_first:
            built = built.to(dtype)
        ps.swap(built, scheme_config(scheme))
        return built if cast_first else built.to(dtype)

    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(1))
    cast_after = model(False)
    with torch.no_grad():
        torch.testing.assert_close(cast_after(ids).logits, model(True)(ids).logits, rtol=0, atol=0)
    if scheme == "proportional":  # its unrotated pairs make the angles another formula; the logits suffice
        return
    assert_exact_angles(cast_after, scheme)
    assert_exact_angles(model(False).to(torch.float32), scheme)
    cast_after.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    assert_exact_angles(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), scheme)
