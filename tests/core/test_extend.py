"""Context extension: RoPE scalings against transformers' ROPE_INIT_FUNCTIONS, caches, tables, composition, errors."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import MAX_POSITIONS, VOCAB, make_model, swapped
from test_checkpoints import logits
from test_errors import assert_untouched, fingerprint
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import hf_posswap as ps
from hf_posswap.core.extend import check_extension, grow_table
from hf_posswap.core.state import swap_state

HEAD_DIM = 16
LONGROPE = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}
# The config.rope_parameters each method must produce for original 64 -> 256 tokens, written out by hand.
EXPECTED = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
             "beta_slow": 1.0},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64, **LONGROPE},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
}
OPTIONS = {"longrope": LONGROPE}
METHODS = ["linear", "ntk", "dynamic", "yarn", "longrope", "llama3"]


def reference(method: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """transformers' own frequencies for the same RoPE on a LLaMA config (theta 1e4, head_dim 16, original 64)."""
    max_positions = MAX_POSITIONS if method == "dynamic" else 4 * MAX_POSITIONS
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                         max_position_embeddings=max_positions,
                         rope_parameters={"rope_theta": 10_000.0, **EXPECTED[method]})
    return ROPE_INIT_FUNCTIONS[EXPECTED[method]["rope_type"]](config, None, seq_len=seq_len)


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ntk"])
def test_native_rope_parameters_and_frequencies_match_transformers(method: str) -> None:
    model = make_model("llama")
    ps.extend_context(model, 4 * MAX_POSITIONS, method, **OPTIONS.get(method, {}))
    assert model.config.rope_parameters == {"rope_theta": 10_000.0, **EXPECTED[method]}
    inv_freq, attention_factor = reference(method)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq, rtol=0, atol=0)
    assert model.model.rotary_emb.attention_scaling == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ntk"])
def test_rope_in_attention_matches_transformers(method: str) -> None:
    """GPT-2 swapped to RoPE rotates inside attention; its frequencies come from the same functions."""
    model = make_model("gpt2")
    ps.swap(model, "rope")
    ps.extend_context(model, 4 * MAX_POSITIONS, method, **OPTIONS.get(method, {}))
    rotary = model.transformer.posswap_positions
    for seq_len in (MAX_POSITIONS, 3 * MAX_POSITIONS):
        expected_freq, expected_factor = reference(method, seq_len if method in ("dynamic", "longrope") else None)
        inv_freq, factor = rotary.frequencies(seq_len, torch.device("cpu"))
        torch.testing.assert_close(inv_freq, expected_freq, rtol=1e-7, atol=0)
        assert factor == pytest.approx(float(expected_factor), rel=1e-7)


def test_ntk_frequencies_equal_the_closed_form() -> None:
    model = make_model("llama")
    ps.extend_context(model, 4 * MAX_POSITIONS, "ntk")
    theta = 10_000.0 * 4.0 ** (HEAD_DIM / (HEAD_DIM - 2))
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": pytest.approx(theta)}
    expected = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"], ids=["native", "in-attention"])
def test_dynamic_is_bit_identical_at_or_below_the_original_length(family: str) -> None:
    plain, scaled = make_model(family), make_model(family)
    if family == "gpt2":
        ps.swap(plain, "rope")
        ps.swap(scaled, "rope")
    ps.extend_context(scaled, 8 * MAX_POSITIONS, "dynamic")
    with torch.no_grad():
        assert torch.equal(scaled(input_ids=ids(MAX_POSITIONS)).logits, plain(input_ids=ids(MAX_POSITIONS)).logits)
        longer = ids(2 * MAX_POSITIONS)
        assert not torch.allclose(scaled(input_ids=longer).logits, plain(input_ids=longer).logits, atol=1e-4)


def generate_logits(model, input_ids, use_cache: bool) -> torch.Tensor:
    out = model.generate(input_ids, max_new_tokens=24, do_sample=False, pad_token_id=0, use_cache=use_cache,
                         return_dict_in_generate=True, output_logits=True)
    return torch.stack(out.logits, 1)


@pytest.mark.parametrize("method", [*METHODS, "self_extend"])
@pytest.mark.parametrize("family", ["llama", "gpt2"], ids=["native", "in-attention"])
def test_cached_generation_past_the_original_length(family: str, method: str) -> None:
    """Prompt inside the original 64 tokens, generation crossing it. Where the cache cannot match a recompute
    (length-dependent methods applied natively), describe() says so, and this is what happens."""
    model = make_model(family)
    if family == "gpt2":
        ps.swap(model, "rope")
    ps.extend_context(model, 4 * MAX_POSITIONS, method, **OPTIONS.get(method, {}))
    prompt = ids(MAX_POSITIONS - 8)
    cached, full = generate_logits(model, prompt, True), generate_logits(model, prompt, False)
    inside = 8  # steps whose length is still within the original 64
    torch.testing.assert_close(cached[:, :inside], full[:, :inside], atol=1e-5, rtol=1e-4)
    note = ps.describe(model).context.get("cache_note", "")
    if method in ("dynamic", "longrope") and family == "llama":
        assert "differ from a full recompute" in note
        if family == "llama":
            assert not torch.allclose(cached[:, inside + 1:], full[:, inside + 1:], atol=1e-4)
    else:
        assert "differ" not in note
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-4)


def test_swap_time_scaling_through_the_rope_config() -> None:
    config = ps.RopeConfig(rope_theta=1e4, scaling=ps.YarnScaling(factor=4.0, original_max_position_embeddings=64))
    llama, gpt2 = make_model("llama"), make_model("gpt2")
    ps.swap(llama, config)
    ps.swap(gpt2, config)
    assert llama.config.rope_parameters["rope_type"] == "yarn"
    inv_freq, factor = reference("yarn")
    torch.testing.assert_close(gpt2.transformer.posswap_positions.inv_freq, inv_freq)
    assert gpt2.transformer.posswap_positions.attention_scaling == pytest.approx(factor)


def test_extending_twice_composes_from_the_original_length() -> None:
    model = make_model("llama")
    ps.extend_context(model, 2 * MAX_POSITIONS, "yarn")
    ps.extend_context(model, 4 * MAX_POSITIONS, "yarn")
    assert model.config.rope_parameters["factor"] == 4.0  # not 2 * 4
    assert model.config.rope_parameters["original_max_position_embeddings"] == MAX_POSITIONS
    context = ps.describe(model).context
    assert (context["original_max_position_embeddings"], context["max_position_embeddings"]) == (64, 256)
    assert "extended from 64 to 256 tokens with 'yarn'" in str(ps.describe(model))
    fresh = make_model("llama")
    ps.extend_context(fresh, 4 * MAX_POSITIONS, "yarn")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids(100)).logits, fresh(input_ids=ids(100)).logits)
    ps.unswap(model)
    assert model.config.max_position_embeddings == MAX_POSITIONS
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 10_000.0}


@pytest.mark.slow
def test_extended_llama_checkpoints_reload_in_vanilla_transformers(tmp_path: Path) -> None:
    cases = {}
    for method in METHODS:
        model = make_model("llama")
        ps.extend_context(model, 4 * MAX_POSITIONS, method, **OPTIONS.get(method, {}))
        with torch.no_grad():
            cases[method] = model(input_ids=ids(150)).logits
        model.save_pretrained(tmp_path / method)
    torch.save({"input_ids": ids(150), "logits": cases}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_posswap"] = None
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for method, expected in data["logits"].items():
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + method).eval()
            with torch.no_grad():
                logits = model(input_ids=data["input_ids"]).logits
            assert torch.equal(logits, expected), (method, (logits - expected).abs().max())
            print("OK", method)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.stdout.count("OK") == len(METHODS), result.stderr[-3000:]


def test_grow_table_interpolate_and_copy() -> None:
    trained = torch.arange(12.0).reshape(4, 3)  # 4 positions, hidden 3
    copied = grow_table(trained, 10, "copy")
    assert torch.equal(copied[:4], trained) and torch.equal(copied[4:8], trained)
    assert torch.equal(copied[8:], trained[:2])
    stretched = grow_table(trained, 7, "interpolate")  # positions 0, 0.5, 1, ... 3 of the trained table
    assert torch.equal(stretched[0], trained[0]) and torch.equal(stretched[-1], trained[-1])
    torch.testing.assert_close(stretched[1], (trained[0] + trained[1]) / 2)


@pytest.mark.parametrize("method", ["interpolate", "copy"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_learned_tables_grow(family: str, method: str) -> None:
    model = make_model(family)
    trained = model.base_model.get_submodule(ps.swap.__globals__["get_family"](model).absolute_table_path).weight
    trained = trained.detach().clone()
    ps.extend_context(model, 3 * MAX_POSITIONS, method)
    ps.extend_context(model, 4 * MAX_POSITIONS, method)  # composes from the original 64 rows
    table = model.base_model.get_submodule(ps.swap.__globals__["get_family"](model).absolute_table_path).weight
    torch.testing.assert_close(table, grow_table(trained, 4 * MAX_POSITIONS, method))
    assert model.config.max_position_embeddings == 4 * MAX_POSITIONS
    if family == "bert":
        assert model.bert.embeddings.position_ids.shape == (1, 4 * MAX_POSITIONS)
        assert model.bert.embeddings.token_type_ids.shape == (1, 4 * MAX_POSITIONS)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids(4 * MAX_POSITIONS)).logits).all()
    ps.unswap(model)
    assert model.config.max_position_embeddings == MAX_POSITIONS


def learned_table(model: torch.nn.Module) -> torch.Tensor:
    return model.base_model.get_submodule(ps.swap.__globals__["get_family"](model).absolute_table_path).weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["interpolate", "copy"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_reloaded_grown_table_grows_again_from_the_trained_rows(tmp_path: Path, family: str, method: str,
                                                                  dtype: torch.dtype) -> None:
    """A checkpoint holds only the grown table (it stays plain transformers): growing it again must start from the
    trained rows it was grown from, as in memory, not from the grown table's first rows."""
    model = make_model(family).to(dtype)
    trained = learned_table(model).detach().clone()
    ps.extend_context(model, 2 * MAX_POSITIONS, method)
    model.save_pretrained(tmp_path)
    auto = AutoModelForCausalLM if family == "gpt2" else AutoModelForMaskedLM
    reloaded = auto.from_pretrained(tmp_path, dtype=dtype)
    ps.extend_context(reloaded, 4 * MAX_POSITIONS, method)
    grown = learned_table(reloaded).detach()
    precision = {} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 0}  # the saved table was rounded to bf16
    torch.testing.assert_close(grown[-1], trained[-1 if method == "interpolate" else MAX_POSITIONS - 1], **precision)
    torch.testing.assert_close(grown, grow_table(trained, 4 * MAX_POSITIONS, method), **precision)


@pytest.mark.parametrize("grown_in", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_table_grown_in_half_precision_grows_again_after_a_float32_reload(tmp_path: Path,
                                                                            grown_in: torch.dtype) -> None:
    """finetune loads in float32: the saved table carries half precision's rounding, which is not a change."""
    model = make_model("gpt2").to(grown_in)
    trained = learned_table(model).detach().float().clone()
    ps.extend_context(model, 2 * MAX_POSITIONS)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ps.extend_context(reloaded, 4 * MAX_POSITIONS)
    torch.testing.assert_close(learned_table(reloaded).detach(), grow_table(trained, 4 * MAX_POSITIONS, "interpolate"),
                               atol=2e-3, rtol=0)


def test_a_table_changed_after_it_was_grown_is_not_grown_again(tmp_path: Path) -> None:
    model = make_model("gpt2")
    ps.extend_context(model, 2 * MAX_POSITIONS)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():  # as fine-tuning at the longer length would
        learned_table(reloaded).add_(1e-3 * torch.randn_like(learned_table(reloaded)))
    before = fingerprint(reloaded)
    with pytest.raises(ps.InvalidConfigError, match=(
            f"grown from {MAX_POSITIONS} to {2 * MAX_POSITIONS} positions by 'interpolate' and has changed since "
            r".*Extend the checkpoint it was grown from instead\.")):
        ps.extend_context(reloaded, 4 * MAX_POSITIONS)
    assert_untouched(reloaded, before)


@pytest.mark.parametrize("scheme", ["alibi", "t5", "none", "sinusoidal"])
def test_schemes_without_a_limit_lift_it(scheme: str) -> None:
    model = make_model("llama")
    ps.swap(model, scheme)
    ps.extend_context(model, 1000)
    assert model.config.max_position_embeddings == 1000
    assert ps.describe(model).context["method"] == "lift"


@pytest.mark.parametrize(
    ("setup", "args", "options", "error", "message"),
    [
        (None, (256, "yarn"), {"factor": 0.5}, ps.InvalidConfigError, r"YarnScaling.factor must be a number >= 1"),
        (None, (32, "yarn"), {}, ps.InvalidConfigError,
         r"max_positions=32 is shorter than the model's current length 64; extend_context only lengthens"),
        ("alibi", (256, "yarn"), {}, ps.InvalidConfigError,
         r"RoPE scaling 'yarn' needs a model with RoPE.*carries alibi\. Swap to RoPE first: "
         r"hf_posswap.swap\(model, 'rope', replace=True\)"),
        (None, (256, "longrope"), {}, ps.InvalidConfigError, r"LongRopeScaling needs `short_factor`"),
        (None, (256, "longrope"), {"short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, ps.InvalidConfigError,
         r"LongRopeScaling factors have 3 entries but this model rotates 16 dims per head, so 8 are needed"),
        (None, (256, "longrope"), {"short_factor": [1.0] * 8, "long_factor": [1.0] * 7}, ps.InvalidConfigError,
         r"short_factor has 8 entries and long_factor 7"),
        (None, (256, "yarnn"), {}, ps.InvalidOptionError, r"Unknown extension method 'yarnn'. Methods: linear"),
        (None, (256, "yarn"), {"beta_fst": 2}, ps.InvalidOptionError,
         r"has no option 'beta_fst'.*Did you mean 'beta_fast'"),
        (None, (256, "copy"), {}, ps.InvalidConfigError, r"'copy' grows a learned position table.*carries rope"),
        (None, (256, "lift"), {}, ps.InvalidConfigError, r"'lift' only records a longer length.*this model has RoPE"),
        (None, (0, "yarn"), {}, ps.InvalidConfigError, r"max_positions must be a positive integer, got 0"),
    ],
    ids=["factor<1", "shorter", "no-rope", "longrope-missing", "longrope-dim", "longrope-mismatch", "unknown-method",
         "unknown-option", "copy-on-rope", "lift-on-rope", "zero"],
)
def test_extension_errors_leave_the_model_untouched(setup, args, options, error, message) -> None:
    model = make_model("llama")
    if setup:
        ps.swap(model, setup)
    before = fingerprint(model)
    with pytest.raises(error, match=message):
        ps.extend_context(model, *args, **options)
    assert_untouched(model, before)


def test_self_extend_groups_from_the_window_on_and_the_option_keeps_the_original_length_exact() -> None:
    """As its authors define it, Self-Extend leaves inputs no longer than the window unchanged and groups longer
    ones, even within the original length; ``exact_within_original`` leaves inputs within the original length
    unchanged (bit for bit)."""
    plain = make_model("llama")
    authors = ps.extend_context(make_model("llama"), 4 * MAX_POSITIONS, "self_extend", neighbor_window=16)
    exact = ps.extend_context(make_model("llama"), 4 * MAX_POSITIONS, "self_extend", neighbor_window=16,
                              exact_within_original=True)
    assert ps.describe(authors).settings["scaling"]["group_size"] == 5  # (64 - 16) * 5 + 16 = 256
    with torch.no_grad():
        assert torch.equal(authors(input_ids=ids(16)).logits, plain(input_ids=ids(16)).logits)
        within = ids(MAX_POSITIONS)
        assert not torch.allclose(authors(input_ids=within).logits, plain(input_ids=within).logits, atol=1e-4)
        assert torch.equal(exact(input_ids=within).logits, plain(input_ids=within).logits)
        longer = ids(3 * MAX_POSITIONS)
        assert not torch.allclose(exact(input_ids=longer).logits, plain(input_ids=longer).logits, atol=1e-4)


@pytest.mark.parametrize("start", [4, 8], ids=["authors", "exact-within-original"])
def test_self_extend_attention_uses_the_papers_grouped_distances(start: int) -> None:
    """Each logit equals q rotated by the Self-Extend relative distance, dotted with the unrotated key:
    d = i - j within the window W, else (i // G + W - W // G) - j // G (Jin et al. 2024, Algorithm 1). Start W = 4
    is the authors' rule (every query); start 8 is ``exact_within_original`` with an original length of 8 (queries
    before it keep d = i - j)."""
    from hf_posswap.core.context import PositionContext
    from hf_posswap.core.self_extend import self_extend_attention
    from hf_posswap.schemes.rope import apply_rotary
    from hf_posswap.schemes.two_pass import TwoPassSettings

    group, window, length, head_dim = 3, 4, 20, 8
    rotary = ps.RopeConfig(rope_theta=100.0).build(_spec(head_dim))
    context = PositionContext(rotary, "rotary", 0, lambda module: True, True, TwoPassSettings(group, window, start))
    query, key, value = torch.randn(1, 1, length, head_dim), torch.randn(1, 1, length, head_dim), torch.eye(length)
    module = torch.nn.Module()
    _, weights = self_extend_attention(module, query, key, value[None, None, :, :head_dim].expand(1, 1, -1, -1),
                                       None, context, scaling=1.0)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    grouped = (i // group + window - window // group) - j // group
    distance = torch.where((i - j < window) | (i < start), i - j, grouped)
    expected = torch.full((length, length), float("-inf"))
    for a in range(length):
        for b in range(a + 1):
            cos, sin = rotary(distance[a, b].reshape(1))
            expected[a, b] = (apply_rotary(query[:, :, a:a + 1], cos, sin) * key[:, :, b:b + 1]).sum()
    torch.testing.assert_close(weights[0, 0], expected.softmax(-1), atol=1e-5, rtol=1e-4)


def test_self_extend_group_too_small_is_refused() -> None:
    model = make_model("llama")
    before = fingerprint(model)
    with pytest.raises(ps.InvalidConfigError, match=r"SelfExtend with group_size=2 and neighbor_window=16 reaches "
                       r"112 tokens, short of 256; use group_size >= 5"):
        ps.extend_context(model, 4 * MAX_POSITIONS, "self_extend", group_size=2)
    assert_untouched(model, before)


def _spec(head_dim: int):
    return ps.schemes.ModelSpec(
        model_type="test", hidden_size=head_dim, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
        is_causal=True, max_positions=64, initializer_range=0.02, native_rope_theta=None, dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_describe_says_what_the_extension_record_holds() -> None:
    model = make_model("llama")
    ps.extend_context(model, 256, "yarn")
    changes = [line for line in str(ps.describe(model)).splitlines() if "config.posswap.extension" in line]
    assert changes == ["    - config.posswap.extension = {'method': 'yarn', 'original_max_position_embeddings': 64, "
                       "'max_position_embeddings': 256}"]


@pytest.mark.parametrize(("family", "scheme", "method"), [
    ("gpt2", None, "interpolate"), ("llama", None, "yarn"), ("gpt2", "rope", "linear"), ("bert", "alibi", "lift"),
])
def test_extend_context_through_peft(family: str, scheme: str | None, method: str) -> None:
    from peft import get_peft_model

    model = make_model(family) if scheme is None else swapped(family, scheme)
    wrapped = get_peft_model(model, ps.lora_config(model))
    assert ps.extend_context(wrapped, 2 * MAX_POSITIONS, method) is wrapped
    assert ps.describe(wrapped).context["max_position_embeddings"] == 2 * MAX_POSITIONS
    long_input = torch.randint(3, VOCAB, (1, 2 * MAX_POSITIONS - 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.isfinite(wrapped(input_ids=long_input).logits).all()
    position_parameters = [name for name, param in wrapped.named_parameters()
                           if param.requires_grad and ("wpe" in name or "posswap" in name)]
    assert not position_parameters, "a grown table under an adapter is a frozen base weight (never saved by it)"


def test_extending_a_mix_keeps_its_trained_position_weights() -> None:
    """A RoPE scaling re-installs a layer mix to scale its RoPE parts; the other parts' trained weights stay."""
    model = make_model("llama")
    ps.swap(model, ps.LayerMix(default="t5", overrides=[("rope", [0])]))
    tables = model.model.get_parameter("posswap_positions.parts.0.tables.0.weight")
    with torch.no_grad():
        tables.add_(1.0)  # as training would
    tables.requires_grad_(False)
    trained = tables.detach().clone()
    ps.extend_context(model, 4 * MAX_POSITIONS, "yarn")
    now = model.model.get_parameter("posswap_positions.parts.0.tables.0.weight")
    assert now is not tables and torch.equal(now, trained) and not now.requires_grad


def test_extending_a_mix_whose_module_an_adapter_trains_is_refused() -> None:
    from peft import get_peft_model

    model = make_model("llama")
    ps.swap(model, ps.LayerMix(default="t5", overrides=[("rope", [0])]))
    wrapped = get_peft_model(model, ps.lora_config(model))  # modules_to_save=["posswap_positions"]
    before = fingerprint(wrapped.get_base_model())
    with pytest.raises(ps.InvalidConfigError, match=r"position module\(s\) model.posswap_positions are trained by the "
                                                    r"peft adapter"):
        ps.extend_context(wrapped, 4 * MAX_POSITIONS, "yarn")
    assert_untouched(wrapped.get_base_model(), before)


def test_extend_refuses_a_table_that_peft_trains() -> None:
    from peft import get_peft_model

    model = swapped("gpt2", "learned")
    wrapped = get_peft_model(model, ps.lora_config(model))  # modules_to_save=["wpe"]
    with pytest.raises(ps.InvalidConfigError, match=r"trained by a peft adapter \(modules_to_save\).*"
                       r"merge_and_unload"):
        ps.extend_context(wrapped, 2 * MAX_POSITIONS, "interpolate")


def test_ntk_base_that_overflows_is_refused() -> None:
    model = make_model("gpt2")
    ps.swap(model, "rope", rope_theta=3e38)
    with pytest.raises(ps.InvalidConfigError, match=r"RopeConfig \(with NTKScaling\).rope_theta must be above 1"):
        ps.extend_context(model, 4 * MAX_POSITIONS, "ntk")


SCALINGS = {"linear": {}, "ntk": {}, "dynamic": {}, "yarn": {}, "llama3": {}, "self_extend": {},
            "longrope": {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}


@pytest.mark.parametrize("method", sorted(SCALINGS))
def test_scaling_factor_must_match_the_lengths(method: str) -> None:
    model = make_model("llama")
    with pytest.raises(ps.InvalidConfigError, match=r"factor=2.0 does not match max_positions=256 over the "
                       r"trained length 64 \(= 4\).*pass max_positions=128"):
        ps.extend_context(model, 256, method, factor=2.0, **SCALINGS[method])
    ps.extend_context(model, 256, method, factor=4.0, **SCALINGS[method])  # consistent: accepted
    assert ps.describe(model).context["max_position_embeddings"] == 256


def test_original_length_must_match_the_model() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"original_max_position_embeddings=32 differs from this "
                       r"model's trained length 64"):
        ps.extend_context(swapped("gpt2", "rope"), 256, "yarn", original_max_position_embeddings=32)


@pytest.mark.parametrize("scheme", ["t5", "alibi"])
def test_lift_keeps_trained_position_weights(scheme: str) -> None:
    model = make_model("gpt2")
    ps.swap(model, "alibi", trainable_slopes=True) if scheme == "alibi" else ps.swap(model, scheme)
    with torch.no_grad():
        for parameter in model.transformer.posswap_positions.parameters():
            parameter.add_(torch.randn_like(parameter))
    before = logits(model)
    ps.extend_context(model, 4 * MAX_POSITIONS, "lift")
    assert torch.equal(logits(model), before)


def test_absurd_lengths_are_refused_before_allocating() -> None:
    model = make_model("gpt2")
    with pytest.raises(ps.InvalidConfigError, match=r"max_positions=1000000000 is past 16777216 \(2\^24\)"):
        ps.extend_context(model, 10**9, "interpolate")
    assert swap_state(model) is None
    with pytest.raises(ps.InvalidConfigError, match=r"LearnedConfig.max_positions=1000000000 is past 16777216"):
        ps.swap(model, "learned", max_positions=10**9)


@pytest.mark.parametrize(("family", "method"), [("gpt2", "yarn"), ("llama", "interpolate"), ("llama", "yarn"),
                                                ("gpt2", "interpolate")], ids=lambda value: str(value))
def test_check_extension_raises_what_extend_would_and_changes_nothing(family: str, method: str) -> None:
    """A command checks its extension before its other work; the check must agree with the extension itself."""
    model = make_model(family)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    described = repr(ps.describe(model))
    try:
        ps.extend_context(copy.deepcopy(model), 256, method)
        expected = None
    except ps.PosSwapError as error:
        expected = str(error)
    if expected is None:
        check_extension(model, 256, method)
    else:
        with pytest.raises(ps.PosSwapError) as refused:
            check_extension(model, 256, method)
        assert str(refused.value) == expected
    assert repr(ps.describe(model)) == described
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
