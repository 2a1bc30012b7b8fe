"""Every user error: a clear message naming the bad value and the fix, and the model left untouched."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_model
from transformers import OPTConfig, OPTForCausalLM

import hf_posswap as ps
from hf_posswap import edits
from hf_posswap.core.state import swap_state


def fingerprint(model: torch.nn.Module) -> tuple:
    """Everything a failed swap could have changed."""
    return (
        {name: id(module) for name, module in model.named_modules()},
        {name: tensor.clone() for name, tensor in model.state_dict().items()},
        model.config.to_json_string(),
        model.config._attn_implementation,
        "forward" in vars(model.base_model),
        hasattr(model, "_posswap_state"),
    )


def assert_untouched(model: torch.nn.Module, before: tuple) -> None:
    after = fingerprint(model)
    assert after[0] == before[0] and after[2:] == before[2:]
    assert after[1].keys() == before[1].keys()
    assert all(torch.equal(after[1][k], before[1][k]) for k in before[1])


@pytest.fixture
def llama() -> torch.nn.Module:
    return make_model("llama")


def test_unknown_scheme_lists_schemes_and_suggests(llama: torch.nn.Module) -> None:
    before = fingerprint(llama)
    known = re.escape(", ".join(sorted(ps.available_schemes())))
    with pytest.raises(ps.UnknownSchemeError, match=rf"Unknown position scheme 'alibbi'.*Known: {known}\..*"
                       r"Did you mean 'alibi'\?"):
        ps.swap(llama, "alibbi")
    assert_untouched(llama, before)


def test_unknown_rope_scaling_lists_the_scalings_and_suggests() -> None:
    from hf_posswap.schemes.rope_scaling import SCALING_REGISTRY

    known = re.escape(", ".join(sorted(SCALING_REGISTRY.names())))
    with pytest.raises(ps.UnknownSchemeError, match=rf"^Unknown RoPE scaling method 'yarnn'\. Known: {known}\. "
                       r"Did you mean 'yarn'\?$"):
        ps.RopeConfig(scaling={"method": "yarnn", "factor": 4.0})


def test_a_data_parallel_wrapper_is_refused_with_the_fix(llama: torch.nn.Module) -> None:
    before = fingerprint(llama)
    with pytest.raises(ps.UnsupportedFamilyError, match=r"DataParallel has no `config.model_type`.*It wraps a "
                       r"LlamaForCausalLM in .module: pass that \(swap\(model.module, ...\)\)"):
        ps.swap(torch.nn.DataParallel(llama), "alibi")
    assert_untouched(llama, before)


def test_unsupported_family_is_named_with_the_supported_ones() -> None:
    model = OPTForCausalLM(OPTConfig(hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                                     vocab_size=50, max_position_embeddings=32, word_embed_proj_dim=32))
    before = fingerprint(model)
    with pytest.raises(ps.UnsupportedFamilyError, match=r"Model family 'opt' \(OPTForCausalLM\) is not supported\. "
                       r"Supported families: gpt2, bert, llama, mistral, qwen2, qwen3"):
        ps.swap(model, "alibi")
    assert_untouched(model, before)


def test_non_transformers_model_is_refused() -> None:
    with pytest.raises(ps.UnsupportedFamilyError, match=r"Linear has no `config.model_type`"):
        ps.swap(torch.nn.Linear(2, 2), "alibi")


def test_unknown_option_lists_the_schemes_options(llama: torch.nn.Module) -> None:
    before = fingerprint(llama)
    with pytest.raises(ps.InvalidOptionError, match=r"Scheme 't5' \(T5BiasConfig\) has no option 'num_bucket'\. "
                       r"Its options are: num_buckets, max_distance, shared_across_layers\. "
                       r"Did you mean 'num_buckets'\?"):
        ps.swap(llama, "t5", num_bucket=8)
    with pytest.raises(ps.InvalidOptionError, match=r"Scheme 'none' \(NoPEConfig\) has no option 'theta'\. "
                       r"Its options are: none\."):
        ps.swap(llama, "none", theta=1.0)
    assert_untouched(llama, before)


@pytest.mark.parametrize(
    ("scheme", "options", "message"),
    [
        ("rope", {"rope_theta": 0.0}, r"RopeConfig.rope_theta must be a positive finite number, got 0.0"),
        ("rope", {"rope_theta": -5}, r"RopeConfig.rope_theta must be a positive finite number, got -5"),
        ("rope", {"rope_theta": float("inf")}, r"RopeConfig.rope_theta must be a positive finite number, got inf"),
        ("rope", {"partial_rotary_factor": 0.0}, r"RopeConfig.partial_rotary_factor must be in \(0, 1\], got 0.0"),
        ("rope", {"partial_rotary_factor": 0.05}, r"rotates 0 of 16 head dims; at least 2 are needed"),
        ("t5", {"num_buckets": 1}, r"T5BiasConfig.num_buckets must be an integer >= 2, got 1"),
        ("t5", {"max_distance": 0}, r"T5BiasConfig.max_distance must be an integer >= 1, got 0"),
        ("t5", {"num_buckets": 32, "max_distance": 8}, r"max_distance=8 must exceed the 16 exact buckets"),
        ("t5", {"shared_across_layers": "yes"}, r"shared_across_layers must be True or False, got 'yes'"),
        ("sinusoidal", {"base": -1.0}, r"SinusoidalConfig.base must be a positive finite number, got -1.0"),
        ("learned", {"max_positions": 0}, r"LearnedConfig.max_positions must be an integer >= 1, got 0"),
        ("alibi", {"trainable_slopes": 1}, r"AlibiConfig.trainable_slopes must be True or False, got 1"),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 12 else None,
)
def test_invalid_values(llama: torch.nn.Module, scheme: str, options: dict, message: str) -> None:
    before = fingerprint(llama)
    with pytest.raises(ps.InvalidConfigError, match=message):
        ps.swap(llama, scheme, **options)
    assert_untouched(llama, before)


def test_config_objects_validate_on_construction() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"rope_theta must be a positive finite number, got 0"):
        ps.RopeConfig(rope_theta=0)


def test_shrinking_a_kept_learned_table_is_refused() -> None:
    model = make_model("gpt2")
    before = fingerprint(model)
    with pytest.raises(ps.InvalidConfigError, match=r"max_positions=10 would shrink the model's learned table of 64 "
                       r"positions; pass a value >= 64 or keep_weights=False"):
        ps.swap(model, "learned", max_positions=10)
    assert_untouched(model, before)


def test_bias_scheme_on_attention_that_cannot_carry_it(llama: torch.nn.Module) -> None:
    llama.set_attn_implementation("flex_attention")
    before = fingerprint(llama)
    with pytest.raises(ps.IncompatibleAttentionError, match=re.escape(
            "The 'alibi' scheme works inside attention, and attention implementation 'flex_attention' cannot carry it "
            "(supported: eager, sdpa). Call model.set_attn_implementation('sdpa') before swapping")):
        ps.swap(llama, "alibi")
    assert_untouched(llama, before)
    ps.swap(llama, "rope", rope_theta=500.0)  # native RoPE needs no attention change: allowed


def test_flash_attention_model_is_refused_for_bias_schemes(llama: torch.nn.Module) -> None:
    llama.config._attn_implementation_internal = "flash_attention_2"  # as a model loaded with flash attention
    with pytest.raises(ps.IncompatibleAttentionError, match=r"attention implementation 'flash_attention_2' cannot"):
        ps.swap(llama, "t5")


def test_swapping_a_swapped_model_points_to_unswap(llama: torch.nn.Module) -> None:
    ps.swap(llama, "alibi")
    before = fingerprint(llama)
    with pytest.raises(ps.AlreadySwappedError, match=re.escape(
            "This model already carries the 'alibi' scheme from hf_posswap. Call hf_posswap.unswap(model) first, "
            "or swap(model, ..., replace=True) to replace it cleanly.")):
        ps.swap(llama, "t5")
    assert_untouched(llama, before)


def test_unswap_of_an_unswapped_model(llama: torch.nn.Module) -> None:
    with pytest.raises(ps.NotSwappedError, match=r"LlamaForCausalLM was not swapped by hf_posswap"):
        ps.unswap(llama)


def test_scheme_of_the_wrong_type(llama: torch.nn.Module) -> None:
    with pytest.raises(ps.InvalidOptionError, match=r"scheme must be a registered name .* got int: 3"):
        ps.swap(llama, 3)  # type: ignore[arg-type]


def test_a_failure_mid_swap_rolls_everything_back(llama: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    before = fingerprint(llama)

    def fail(self: edits.WrapForward) -> None:
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(edits.WrapForward, "apply", fail)
    with pytest.raises(RuntimeError, match="simulated failure"):
        ps.swap(llama, "alibi")
    assert_untouched(llama, before)


def test_a_failed_replace_keeps_the_earlier_swap(llama: torch.nn.Module) -> None:
    ps.swap(llama, "alibi")
    before = fingerprint(llama)
    with pytest.raises(ps.InvalidConfigError):
        ps.swap(llama, "t5", replace=True, num_buckets=4, max_distance=1)
    assert_untouched(llama, before)
    assert ps.describe(llama).scheme == "alibi"


def test_a_replace_refused_by_the_models_own_rope_scaling_keeps_the_earlier_swap() -> None:
    """``swap(model, "rope")`` reads the model's own RoPE scaling, which only shows once the earlier swap is undone;
    a scaling the RoPE config refuses must put the earlier swap back."""
    from conftest import MODEL_CLASSES, tiny_config

    config = tiny_config("llama")
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": 0.5}
    model = MODEL_CLASSES["llama"](config).eval()
    ps.swap(model, "alibi")
    before = fingerprint(model)
    with pytest.raises(ps.InvalidConfigError, match="factor"):
        ps.swap(model, "rope", replace=True)
    assert_untouched(model, before)
    assert ps.describe(model).scheme == "alibi"


@pytest.mark.parametrize("theta", [1e-300, 0.5, 1.0, 1e300])
def test_degenerate_rope_theta_is_refused(theta: float) -> None:
    model = make_model("gpt2")
    message = r"rope_theta must be above 1 and at most 3.4e\+38, got " + re.escape(repr(theta))
    with pytest.raises(ps.InvalidConfigError, match=message):
        ps.swap(model, "rope", rope_theta=theta)
    assert swap_state(model) is None


def test_degenerate_sinusoidal_base_is_refused() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"SinusoidalConfig.base must be above 1.*got 1e-300"):
        ps.SinusoidalConfig(base=1e-300)
