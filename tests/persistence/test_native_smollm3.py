"""save_native: a LLaMA whose layers mix its own RoPE with NoPE is saved as transformers' own ``smollm3``, which
vanilla transformers reloads to the same logits.

The references are transformers' code, not hf_posswap's: LLaMA's and SmolLM3's modelling files, and a LLaMA whose
NoPE layers get cos = 1, sin = 0 from a forward pre-hook written here (no hf_posswap involved).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_model, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

import hf_posswap as ps
from hf_posswap.evaluation import byte_tokenizer
from hf_posswap.persistence import native_smollm3
from hf_posswap.persistence.native_smollm3 import NotNativeError

save_native = ps.save_native

LAYERS = 4


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 4-layer LLaMA with grouped-query heads (4 query, 2 key/value) whose weights make positions matter."""
    torch.manual_seed(seed)
    config = tiny_config("llama")
    config.num_hidden_layers = LAYERS
    for key, value in overrides.items():
        setattr(config, key, value)
    config.__post_init__()
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)  # sharper attention: a layer's RoPE moves the logits clearly
    return model


def hook_nope(model: LlamaForCausalLM, layers: list[int]) -> None:
    """Give the chosen layers cos = 1, sin = 0 (no rotation) through a pre-hook on their self-attention."""

    def no_rotation(module, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = (torch.ones_like(cos), torch.zeros_like(sin))
        return args, kwargs

    for index in layers:
        model.model.layers[index].self_attn.register_forward_pre_hook(no_rotation, with_kwargs=True)


def smollm3_copy(llama: LlamaForCausalLM, flags: list[int]) -> SmolLM3ForCausalLM:
    """transformers' SmolLM3 with the LLaMA's sizes and weights, built by hand (not by hf_posswap)."""
    fields = {key: value for key, value in llama.config.to_dict().items() if key in SmolLM3Config.__dataclass_fields__}
    config = SmolLM3Config(**{**fields, "no_rope_layers": flags}, head_dim=llama.config.head_dim)
    model = SmolLM3ForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    return model


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


INPUT = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
#: longer than the tiny models' trained 64 positions: extended RoPE layers scale here
LONG = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(2))
#: (how the LLaMA is swapped, its NoPE layers)
MIXES = {
    "all-nope": (lambda model: ps.swap(model, "none"), [0, 1, 2, 3]),
    "none-on-layers-1-3": (lambda model: ps.swap(model, "none", layers=[1, 3]), [1, 3]),
    "layer-mix-0-2": (lambda model: ps.swap(model, ps.LayerMix(default="rope", overrides={"none": [0, 2]})), [0, 2]),
    "smollm3-preset": (lambda model: ps.swap(model, ps.smollm3_nope(model)), [3]),
    "smollm3-preset-interval-2": (lambda model: ps.swap(model, ps.smollm3_nope(model, 2)), [1, 3]),
}


# -- the facts the conversion rests on, checked against transformers' own modelling code -----------------------------


@pytest.mark.parametrize("overrides", [{}, *(pytest.param(o, marks=pytest.mark.slow) for o in (
    {"head_dim": 32}, {"attention_bias": True, "mlp_bias": True}, {"tie_word_embeddings": True}))],
    ids=["plain", "head-dim-32", "attention-and-mlp-bias", "tied-embeddings"])
def test_smollm3_with_rope_everywhere_is_llama(overrides) -> None:
    llama = tiny_llama(**overrides)
    smol = smollm3_copy(llama, [1] * LAYERS)
    assert torch.equal(logits(smol, INPUT), logits(llama, INPUT))


def test_no_rope_layers_means_one_for_rope_indexed_by_layer() -> None:
    llama = tiny_llama()
    hook_nope(llama, [1, 3])
    expected = logits(llama, INPUT)
    assert torch.equal(logits(smollm3_copy(llama, [1, 0, 1, 0]), INPUT), expected)
    for wrong in ([0, 1, 0, 1], [1, 1, 1, 0], [1, 1, 1, 1]):  # inverted, shifted, no NoPE: all visibly different
        assert (logits(smollm3_copy(llama, wrong), INPUT) - expected).abs().max() > 1e-2


# -- save_native -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [m if m == "smollm3-preset" else pytest.param(m, marks=pytest.mark.slow)
                                 for m in MIXES])
def test_rope_and_nope_layers_save_as_smollm3_with_the_same_logits(tmp_path: Path, mix: str) -> None:
    make, nope = MIXES[mix]
    model = make(tiny_llama())
    save_native(model, tmp_path / "native")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(reloaded) is SmolLM3ForCausalLM
    assert reloaded.config.no_rope_layers == [int(i not in nope) for i in range(LAYERS)]
    assert torch.equal(logits(reloaded, INPUT), logits(model, INPUT))
    reference = tiny_llama()  # transformers' LLaMA with its own NoPE layers, no hf_posswap
    hook_nope(reference, nope)
    torch.testing.assert_close(logits(reloaded, INPUT), logits(reference, INPUT), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_smollm3_preset_is_transformers_own_default_layout(tmp_path: Path) -> None:
    model = ps.swap(tiny_llama(num_hidden_layers=8), ps.smollm3_nope(8))
    save_native(model, tmp_path / "native")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native")
    assert reloaded.config.no_rope_layers == SmolLM3Config(num_hidden_layers=8).no_rope_layers == [1, 1, 1, 0] * 2


@pytest.mark.parametrize("method", ["yarn", *(pytest.param(m, marks=pytest.mark.slow) for m in
                                               ("linear", "dynamic", "llama3", "ntk"))])
def test_extended_rope_layers_save_as_smollm3_rope_parameters(tmp_path: Path, method: str) -> None:
    model = ps.swap(tiny_llama(), "none", layers=[3])
    ps.extend_context(model, 256, method)
    save_native(model, tmp_path / "native")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    expected_type = "default" if method == "ntk" else method  # static NTK is a larger rope_theta
    assert reloaded.config.rope_parameters["rope_type"] == expected_type
    torch.testing.assert_close(logits(reloaded, LONG), logits(model, LONG), rtol=0, atol=1e-5)
    reference = tiny_llama(rope_parameters=reloaded.config.rope_parameters,
                           max_position_embeddings=reloaded.config.max_position_embeddings)
    hook_nope(reference, [3])  # transformers' LLaMA with that scaling, its layer 3 without RoPE
    torch.testing.assert_close(logits(reloaded, LONG), logits(reference, LONG), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_save_native_keeps_what_save_pretrained_writes_natively(tmp_path: Path) -> None:
    model = ps.swap(tiny_llama(), ps.RopeConfig(scaling=ps.YarnScaling(factor=2.0)))
    save_native(model, tmp_path / "rope")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "rope").eval()
    assert type(reloaded) is LlamaForCausalLM and reloaded.config.rope_parameters["rope_type"] == "yarn"
    assert torch.equal(logits(reloaded, INPUT), logits(model, INPUT))


@pytest.mark.parametrize(("model_type", "scheme", "message"), [
    ("llama", "alibi", r"'alibi' on layers \[0, 1, 2, 3\]"),
    ("llama", ps.RopeConfig(partial_rotary_factor=0.5),
     r"partial RoPE \(partial_rotary_factor=0.5\) on layers \[0, 1, 2, 3\]"),
    ("llama", ps.RopeConfig(scaling=ps.SelfExtend(group_size=4, neighbor_window=8)), "Self-Extend"),
    ("llama", ps.LayerMix(default="rope", overrides={"alibi": [0, 2]}), r"has 'alibi' on layers \[0, 2\]\. "),
    ("llama", ps.LayerMix(default="rope", overrides={"none": [3]}, attn_temperature_tuning=True),
     r"NoPE with Llama 4's attention temperature on layers \[3\]"),
    ("llama", ps.LayerMix(default="rope", overrides=[(ps.RopeConfig(rope_theta=5e5), [2])]),
     r"one rope_parameters for all RoPE layers; this model's RoPE layers use 2"),
    ("qwen2", "none", r"'qwen2' \(biases on q/k/v but not on the output projection\)"),
    ("qwen3", "none", r"'qwen3' \(RMSNorm on queries and keys\)"),
    ("gpt2", "alibi", r"Only LLaMA \('llama'\) models convert to smollm3.*this model is 'gpt2'"),
], ids=["alibi", "partial-rope", "self-extend", "mix-with-alibi", "irope-temperature", "two-ropes", "qwen2",
        "qwen3", "gpt2"])
def test_what_smollm3_cannot_express_is_refused_and_nothing_is_written(tmp_path: Path, model_type, scheme,
                                                                        message) -> None:
    if model_type == "llama":
        model = tiny_llama()
    elif model_type == "gpt2":
        model = make_model("gpt2")
    else:
        config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        model = AutoModelForCausalLM.from_config(config).eval()
    ps.swap(model, scheme)
    with pytest.raises(NotNativeError, match=message) as caught:
        save_native(model, tmp_path / "out")
    assert "save_pretrained" in str(caught.value) and "export_standalone" in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_peft_model_is_refused_with_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(ps.swap(tiny_llama(), "none"), LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(NotNativeError, match=r"merge_and_unload\(\)"):
        save_native(model, tmp_path / "out")


@pytest.mark.parametrize("case", ["offloaded", "quantised"])
def test_weights_that_are_not_all_here_are_refused(tmp_path: Path, case: str) -> None:
    model = ps.swap(tiny_llama(), "none")
    if case == "offloaded":  # what accelerate's disk offloading leaves in the module
        model.lm_head.weight = torch.nn.Parameter(torch.empty(VOCAB, 64, device="meta"))
        message = r"offloaded to the meta device .* load it fully"
    else:
        model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
        message = r"is quantised \(config.quantization_config\)"
    with pytest.raises(NotNativeError, match=message):
        save_native(model, tmp_path / "out")


def test_a_conversion_that_changes_the_logits_is_refused(tmp_path: Path, monkeypatch) -> None:
    model = ps.swap(tiny_llama(), "none")
    real = native_smollm3.no_rope_layers

    def off_by_one(model):
        flags, rope_parameters = real(model)
        return flags[1:] + [1], rope_parameters

    monkeypatch.setattr(native_smollm3, "no_rope_layers", off_by_one)
    with pytest.raises(NotNativeError, match=r"differ from the swapped model's by .* hf_posswap bug"):
        save_native(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_save_pretrained_keeps_the_hf_posswap_format(tmp_path: Path) -> None:
    """The design choice: only save_native converts. save_pretrained keeps what reloads as the swapped LLaMA (unswap,
    describe and extend_context still work); the smollm3 checkpoint reloads as a different class with no swap."""
    model = ps.swap(tiny_llama(), "none")
    model.save_pretrained(tmp_path / "posswap")
    assert '"model_type": "hf_posswap_llama"' in (tmp_path / "posswap" / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "posswap").eval()
    save_native(reloaded, tmp_path / "native")  # the reloaded swap still converts when asked
    ps.unswap(reloaded)
    assert torch.equal(logits(reloaded, INPUT), logits(tiny_llama(), INPUT))
    with pytest.raises(ps.NotSwappedError, match="SmolLM3ForCausalLM was not swapped"):
        ps.unswap(AutoModelForCausalLM.from_pretrained(tmp_path / "native"))


# -- reload where hf_posswap cannot be imported ----------------------------------------------------------------------

LOADER = textwrap.dedent("""
    import sys
    sys.modules["hf_posswap"] = None  # not importable at all
    import torch, transformers
    data = torch.load(sys.argv[2])
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits
        tokens = model.generate(data["input_ids"][:, :60], max_new_tokens=12, do_sample=False)
    # Another process: BLAS may sum in another order, so bit equality is not promised; a wrong layer moves logits
    # by 1e-2 and more.
    gap = (logits - data["logits"]).abs().max().item()
    print("LOGITS", "EQUAL" if gap <= 1e-5 else f"DIFFERENT by {gap}", type(model).__name__)
    print("GENERATE", "EQUAL" if torch.equal(tokens, data["tokens"]) else f"DIFFERENT {tokens} {data['tokens']}")
    print("NO_ROPE_LAYERS", model.config.no_rope_layers)
    print("TOKENIZER", transformers.AutoTokenizer.from_pretrained(sys.argv[1]).decode([71, 72]))
    """)


def reload_without_hf_posswap(model: torch.nn.Module, tmp_path: Path) -> str:
    """save_native, then reload in a fresh process where ``import hf_posswap`` fails; returns what it printed."""
    with torch.no_grad():  # 60 prompt tokens + 12 new ones: past the trained 64 positions
        tokens = model.generate(LONG[:, :60], max_new_tokens=12, do_sample=False)
    torch.save({"input_ids": LONG, "logits": logits(model, LONG), "tokens": tokens}, tmp_path / "io.pt")
    save_native(model, tmp_path / "native", tokenizer=byte_tokenizer())
    result = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "native"), str(tmp_path / "io.pt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("case", ["smollm3-preset", "all-nope", "extended-yarn"])
@pytest.mark.slow
def test_reloads_without_hf_posswap_to_the_same_logits_and_generation(tmp_path: Path, case: str) -> None:
    model = tiny_llama()
    if case == "all-nope":
        ps.swap(model, "none")
    else:
        ps.swap(model, ps.smollm3_nope(model))
    if case == "extended-yarn":
        ps.extend_context(model, 256, "yarn")
    output = reload_without_hf_posswap(model, tmp_path)
    assert "LOGITS EQUAL SmolLM3ForCausalLM" in output and "GENERATE EQUAL" in output, output
    flags = [0, 0, 0, 0] if case == "all-nope" else [1, 1, 1, 0]
    assert f"NO_ROPE_LAYERS {flags}" in output and "TOKENIZER hi" in output, output
