"""Gemma 3 (text), Phi-3, GPT-NeoX and RoBERTa: what each adapter adds beyond the family x scheme matrix.

Identity swaps against the model's own forward, native RoPE swaps against the model transformers builds from the
same config (and a vanilla reload), partial rotary inside attention against the family's own partial rotary,
Gemma 3's RoPE per layer type, RoBERTa's position numbering, LoRA targets.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import MODEL_CLASSES, VOCAB, make_model, tiny_config

import hf_posswap as ps
from hf_posswap.errors import UnsupportedFamilyError
from hf_posswap.families import get_family

ROTARY = {"gemma3_text": 1.0, "phi3": 0.5, "gpt_neox": 0.25, "olmo2": 1.0}  # own rotated fraction (tiny configs)
INPUT = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
LONG = torch.randint(3, VOCAB, (1, 100), generator=torch.Generator().manual_seed(1))


def logits(model: torch.nn.Module, input_ids: torch.Tensor = INPUT, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, **kwargs).logits


def vanilla_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The model transformers itself builds from ``model``'s config, with ``model``'s weights."""
    twin = MODEL_CLASSES[model.config.model_type](copy.deepcopy(model.config)).eval()
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in key for key in missing), (missing, unexpected)
    return twin


@pytest.mark.parametrize("family", list(ROTARY))
def test_swap_to_the_models_own_rope_is_bit_identical(family: str) -> None:
    model = make_model(family)
    before, config_before = logits(model), model.config.to_dict()
    ps.swap(model, ps.RopeConfig(partial_rotary_factor=ROTARY[family]))
    assert ps.describe(model).native
    assert torch.equal(logits(model), before)
    ps.unswap(model)
    assert model.config.to_dict() == config_before


def test_roberta_learned_swap_keeping_the_table_is_bit_identical_with_padding() -> None:
    """RoBERTa numbers positions from padding_idx + 1 and skips pad tokens; the kept table sees the same ids."""
    model = make_model("roberta")
    batch = INPUT.clone()
    batch[1, :7] = model.config.pad_token_id  # left padding, by token (RoBERTa builds its ids from input_ids)
    mask = (batch != model.config.pad_token_id).long()
    before = logits(model, batch, attention_mask=mask)
    ps.swap(model, "learned")
    assert torch.equal(logits(model, batch, attention_mask=mask), before)
    # the padded row equals the row alone: padding took no position
    alone = logits(model, batch[1:, 7:])
    torch.testing.assert_close(logits(model, batch, attention_mask=mask)[1, 7:], alone[0], atol=1e-5, rtol=1e-4)


def test_roberta_positions_start_after_the_padding_index() -> None:
    """A table lookup past the end names RoBERTa's last position id (pad_token_id + 1 + length - 1)."""
    model = make_model("roberta")
    ps.swap(model, "learned")
    last = model.config.pad_token_id + LONG.shape[1]
    with pytest.raises(IndexError, match=rf"Position {last} is past the end"):
        model(input_ids=LONG)
    ps.swap(model, "alibi", replace=True)  # a scheme without a length limit runs past the table
    assert torch.isfinite(logits(model, LONG)).all()


@pytest.mark.parametrize(("family", "scaling"), [
    ("phi3", ps.LongRopeScaling(factor=4.0, short_factor=[1.0] * 4, long_factor=[1.5, 2.0, 3.0, 4.0])),
    ("gpt_neox", ps.YarnScaling(factor=4.0)),
    pytest.param("gpt_neox", ps.DynamicNTKScaling(factor=4.0), marks=pytest.mark.slow),
    ("gemma3_text", ps.YarnScaling(factor=4.0)),
    pytest.param("gemma3_text", ps.LinearScaling(factor=8.0), marks=pytest.mark.slow),
], ids=lambda value: value if isinstance(value, str) else type(value).__name__)
def test_native_rope_swaps_equal_the_model_transformers_builds(family: str, scaling: ps.RopeScaling) -> None:
    model = make_model(family)
    ps.swap(model, ps.RopeConfig(partial_rotary_factor=ROTARY[family], scaling=scaling))
    assert ps.describe(model).native
    torch.testing.assert_close(logits(model, LONG), logits(vanilla_twin(model), LONG), rtol=0, atol=0)


def test_phi3_takes_only_default_and_longrope_natively() -> None:
    """Phi3Config rejects other rope types: YaRN on Phi-3 runs inside attention and still changes the model."""
    model = make_model("phi3")
    before = logits(model, LONG)
    ps.swap(model, ps.RopeConfig(partial_rotary_factor=0.5, scaling=ps.YarnScaling(factor=4.0)))
    assert not ps.describe(model).native
    assert model.config.rope_parameters["rope_type"] == "default"
    assert not torch.allclose(logits(model, LONG), before, atol=1e-4)


@pytest.mark.parametrize(("family", "rope"), [
    ("gpt_neox", ps.RopeConfig(partial_rotary_factor=0.25, scaling=ps.YarnScaling(factor=4.0))),
    pytest.param("gpt_neox", ps.RopeConfig(rope_theta=500.0, partial_rotary_factor=0.5), marks=pytest.mark.slow),
    ("phi3", ps.RopeConfig(partial_rotary_factor=0.5)),
    pytest.param("gemma3_text", ps.RopeConfig(rope_theta=1_000_000.0), marks=pytest.mark.slow),
], ids=["gpt_neox-yarn", "gpt_neox-half", "phi3-own", "gemma3_text-global"])
def test_partial_rope_inside_attention_equals_the_familys_own(
    family: str, rope: ps.RopeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same RoPE, once native (the family's rotary class and apply_rotary_pos_emb) and once forced into
    hf_posswap's attention: same logits, so the rotated dims, their pairing and the pass-through dims agree."""
    native = make_model(family)
    ps.swap(native, rope)
    assert ps.describe(native).native
    in_attention = make_model(family)
    if family == "gemma3_text":  # one RoPE for both layer types: make the local layers' θ the global one first
        in_attention.config.rope_parameters["sliding_attention"]["rope_theta"] = 1_000_000.0
        native = make_model(family)
        native.config.rope_parameters["sliding_attention"]["rope_theta"] = 1_000_000.0
        ps.swap(native, rope)
    monkeypatch.setattr(type(get_family(in_attention)), "native_rope_edits", lambda self, model, config: None)
    ps.swap(in_attention, rope)
    assert not ps.describe(in_attention).native
    mask = torch.ones_like(INPUT)
    mask[1, :6] = 0
    for inputs in ({"input_ids": LONG}, {"input_ids": INPUT, "attention_mask": mask}):
        with torch.no_grad():
            torch.testing.assert_close(in_attention(**inputs).logits, native(**inputs).logits, atol=1e-5, rtol=1e-4)


def test_gemma3_rope_swaps_set_the_global_layers_and_keep_the_local_ones() -> None:
    """Gemma 3 scales only its global layers' RoPE (the 128K checkpoints: linear x8 on θ=1e6, local θ=1e4 as is);
    extend_context does the same with YaRN, and the model equals the one transformers builds from that config."""
    config = tiny_config("gemma3_text")
    config.rope_parameters["full_attention"] = {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0}
    torch.manual_seed(0)
    model = MODEL_CLASSES["gemma3_text"](config).eval()
    local = dict(model.config.rope_parameters["sliding_attention"])
    before = logits(model, LONG)
    ps.swap(model, ps.RopeConfig(scaling=ps.LinearScaling(factor=8.0)))  # its own RoPE, θ kept per layer type
    assert torch.equal(logits(model, LONG), before)
    ps.unswap(model)
    ps.extend_context(model, 256, "yarn")
    parameters = model.config.rope_parameters
    assert parameters["sliding_attention"] == local
    assert parameters["full_attention"]["rope_type"] == "yarn" and parameters["full_attention"]["factor"] == 4.0
    assert parameters["full_attention"]["rope_theta"] == 1_000_000.0
    rotary = model.model.rotary_emb
    own_default = type(rotary).compute_default_rope_parameters  # transformers' own local-layer frequencies
    local_inv_freq, _ = own_default(tiny_config("gemma3_text"), None, layer_type="sliding_attention")
    assert torch.equal(rotary.sliding_attention_inv_freq, local_inv_freq)
    torch.testing.assert_close(logits(model, LONG), logits(vanilla_twin(model), LONG), rtol=0, atol=0)
    assert not torch.allclose(logits(model, LONG), before, atol=1e-4)
    ps.unswap(model)
    assert torch.equal(logits(model, LONG), before)


def test_gemma3_non_rope_schemes_silence_every_layer_type() -> None:
    """NoPE on Gemma 3: neither layer type keeps its RoPE (the identity rotary answers every layer type), so
    position ids that skip (not a constant shift, which RoPE would not see either) change nothing."""
    skipping = 3 * torch.arange(30)[None].expand(2, -1)
    native = make_model("gemma3_text")
    assert not torch.allclose(logits(native, position_ids=skipping), logits(native), atol=1e-4)
    ps.swap(native, "none")
    torch.testing.assert_close(logits(native, position_ids=skipping), logits(native), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "gpt_neox", "roberta"])
def test_lora_targets_name_attention_projections(family: str) -> None:
    from peft import get_peft_model

    model = make_model(family)
    names = [name for name, _ in model.named_modules()]
    for target in get_family(model).lora_target_modules:
        assert any(name.endswith(f".{target}") and "attention" in name.replace("self_attn", "attention")
                   for name in names), target
    peft_model = get_peft_model(model, ps.lora_config(model, r=2))
    assert sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) > 0


@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_extending_an_unswapped_partial_rotary_model_keeps_its_rotated_fraction(family: str) -> None:
    model = make_model(family)
    ps.extend_context(model, 256, "longrope" if family == "phi3" else "yarn",
                      **({"short_factor": [1.0] * 4, "long_factor": [4.0] * 4} if family == "phi3" else {}))
    assert model.config.rope_parameters["partial_rotary_factor"] == ROTARY[family]


def test_families_without_an_adapter_still_fail_clearly() -> None:
    from transformers import Cohere2Config, Cohere2ForCausalLM

    model = Cohere2ForCausalLM(Cohere2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=128))
    with pytest.raises(UnsupportedFamilyError, match=r"'cohere2'.*not supported.*gemma3_text.*roberta"):
        ps.swap(model, "alibi")


@pytest.mark.slow
def test_native_swaps_reload_in_vanilla_transformers(tmp_path: Path) -> None:
    """Saved after a native swap, each family reloads without hf_posswap to the same logits."""
    cases = {
        "phi3": ps.RopeConfig(partial_rotary_factor=0.5, rope_theta=2_500.0),
        "gpt_neox": ps.RopeConfig(partial_rotary_factor=0.5, scaling=ps.YarnScaling(factor=4.0)),
        "gpt_neox-whole-heads": ps.RopeConfig(partial_rotary_factor=1.0),  # GPTNeoXConfig would fill in 0.25
        "gemma3_text": ps.RopeConfig(scaling=ps.YarnScaling(factor=4.0)),
        "olmo2": ps.RopeConfig(scaling=ps.YarnScaling(factor=4.0)),
    }
    expected = {}
    for name, rope in cases.items():
        model = make_model(name.split("-")[0])
        ps.swap(model, rope)
        assert ps.describe(model).native
        model.save_pretrained(tmp_path / name)
        expected[name] = logits(model, LONG)
    torch.save({"input_ids": LONG, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_posswap"] = None  # any import of it fails
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "io.pt")!r})
        for family, expected in data["expected"].items():
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + family).eval()
            with torch.no_grad():
                got = model(input_ids=data["input_ids"]).logits
            # another process may sum in another BLAS order: 1e-5, far below what a position change does
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            print("VANILLA_OK", family, model.config.rope_parameters)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.count("VANILLA_OK") == len(cases), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), [
    ("gemma3_text", ps.AlibiConfig()),
    ("phi3", ps.RopeConfig(partial_rotary_factor=0.5, scaling=ps.YarnScaling(factor=4.0))),  # in attention
    ("gpt_neox", ps.T5BiasConfig(num_buckets=16, max_distance=32)),
    ("roberta", ps.SinusoidalConfig()),
], ids=["gemma3_text-alibi", "phi3-yarn", "gpt_neox-t5", "roberta-sinusoidal"])
def test_standalone_export_of_each_family_loads_without_hf_posswap(tmp_path: Path, family: str, scheme) -> None:
    from test_export import load_without_hf_posswap

    model = make_model(family)
    ps.swap(model, scheme)
    assert not ps.describe(model).native
    input_ids = LONG if family != "roberta" else LONG[:, :40]
    torch.save({"input_ids": input_ids, "expected": logits(model, input_ids)}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    auto = "AutoModelForMaskedLM" if family == "roberta" else "AutoModelForCausalLM"
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", auto)


def test_swapped_gpt_neox_checkpoint_reloads_its_head(tmp_path: Path) -> None:
    """transformers saves GPT-NeoX's head as embed_out; the swapped checkpoint (hf_posswap_gpt_neox) renames it back."""
    from transformers import AutoModelForCausalLM

    model = make_model("gpt_neox")
    ps.swap(model, "alibi")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize("scheme", ["alibi", pytest.param("t5", marks=pytest.mark.slow),
                                    pytest.param("rope", marks=pytest.mark.slow)])
def test_olmo2_runs_through_llamas_adapter(scheme: str) -> None:
    """OLMo 2 (LLaMA's adapter, q/k RMSNorm over whole projections): cached generation equals a full recompute and a
    left-padded row equals the row alone. The whole family x scheme matrix passed once for olmo2; it is not in
    conftest.FAMILIES to keep CI time down."""
    from conftest import scheme_config

    model = make_model("olmo2")
    ps.swap(model, scheme_config(scheme))
    assert ps.describe(model).native == (scheme == "rope")
    prompt = INPUT[:1, :8]
    kwargs = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": 8, "return_dict_in_generate": True,
              "output_logits": True}
    cached = model.generate(prompt, use_cache=True, **kwargs)
    recomputed = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(recomputed.logits), atol=1e-5, rtol=1e-4)
    batch, mask = INPUT[:, :12].clone(), torch.ones(2, 12, dtype=torch.long)
    batch[1, :5], mask[1, :5] = 0, 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    together = logits(model, batch, attention_mask=mask, position_ids=position_ids)
    torch.testing.assert_close(together[1, 5:], logits(model, batch[1:, 5:])[0], atol=1e-5, rtol=1e-4)
