"""CONTRIBUTING.md's two walk-throughs, run: a new scheme and a new family, each through swap, save and reload,
cached generation, the standalone export and the CLI's listing. CONTRIBUTING quotes this file, so the walk-through
fails here the day the contracts it describes change.

The toy scheme (``toy_decay``: a logit bias -rate_h * |i - j| with one learned rate per head) and the toy family
(OLMo 1, whose layout is LLaMA's, mapped onto the LLaMA adapter) are defined below exactly as a contributor would
write them in ``hf_posswap/schemes/toy_decay.py`` and ``hf_posswap/families/olmo.py``; the fixture registers them for
this module only and leaves every registry as it found it.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, OlmoConfig, OlmoForCausalLM

import hf_posswap as ps
from hf_posswap.cli.main import main
from hf_posswap.families.base import FAMILY_REGISTRY, register_family
from hf_posswap.families.llama import LlamaAdapter
from hf_posswap.persistence import export as export_module
from hf_posswap.persistence.autoload import AUTO_CLASSES, register_auto_classes
from hf_posswap.schemes.base import (
    SCHEME_REGISTRY,
    BiasPositions,
    ModelSpec,
    SchemeConfig,
    register_scheme,
    require_positive,
)

# --- step 1 of "Adding a scheme": the module and its config (hf_posswap/schemes/toy_decay.py) ---------------------


class ToyDecayBias(BiasPositions):
    """bias[h, i, j] = -rate_h * |i - j| (ALiBi's shape, Press et al. 2022, with the slopes learned per head)."""

    def __init__(self, num_heads: int, rate: float) -> None:
        super().__init__()
        self.rate = nn.Parameter(torch.full((num_heads,), float(rate)))

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        distance = (query_pos[..., :, None] - key_pos[..., None, :]).abs().float()  # [..., q, kv]
        rate = self.rate.float()
        if distance.dim() == 2:
            return -(rate[:, None, None] * distance).unsqueeze(0)
        return -(rate[None, :, None, None] * distance[:, None])


@dataclass
class ToyDecayConfig(SchemeConfig):
    """A logit bias -rate_h * |i - j| per head h, rates learned from ``rate`` (ALiBi's form, Press et al. 2022,
    "Train Short, Test Long", with the slopes learned per head).

    Args:
        rate: the starting rate of every head (> 0).
    """

    name = "toy_decay"
    kind = "bias"
    paper = "a toy for CONTRIBUTING.md (ALiBi's form: Press et al. 2022)"

    rate: float = 0.05

    def validate(self) -> None:
        require_positive("ToyDecayConfig", "rate", self.rate)

    def build(self, spec: ModelSpec) -> ToyDecayBias:
        return ToyDecayBias(spec.num_heads, self.rate)


# --- step 1 of "Adding a family": the adapter (hf_posswap/families/olmo.py) ---------------------------------------


class OlmoAdapter(LlamaAdapter):
    """OLMo 1: LLaMA's layout (``model.rotary_emb``, ``self_attn`` modules, ``config.rope_parameters``)."""

    name = "olmo"
    model_types = ("olmo",)


# what `@register_scheme` / `@register_family` on the classes do in the package, and what the bundle must run too
REGISTRATION = "register_scheme(ToyDecayConfig)\nregister_family(OlmoAdapter)\n"
VOCAB = 64


def _unregister_auto(model_type: str) -> None:
    """Undo transformers' Auto registrations of ``model_type`` (those hf_posswap made for the toy family)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING._extra_content.pop(model_type, None)
    for auto in AUTO_CLASSES:
        auto._model_mapping._extra_content.pop(config_class, None)


@pytest.fixture(scope="module")
def registered():
    """Register the toy scheme and family (and the Auto classes that reload swapped OLMo checkpoints); afterwards
    every registry holds what it held before."""
    schemes, families = SCHEME_REGISTRY.names(), FAMILY_REGISTRY.names()
    register_scheme(ToyDecayConfig)
    register_family(OlmoAdapter)
    register_auto_classes(["olmo"])  # step 2 of "Adding a family" (import hf_posswap does it: register_config_classes)
    yield
    SCHEME_REGISTRY._items.pop("toy_decay")
    FAMILY_REGISTRY._items.pop("olmo")
    _unregister_auto("hf_posswap_olmo")
    assert SCHEME_REGISTRY.names() == schemes and FAMILY_REGISTRY.names() == families


def tiny_olmo(seed: int = 0) -> OlmoForCausalLM:
    torch.manual_seed(seed)
    config = OlmoConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return OlmoForCausalLM(config).eval()


def tiny_llama(seed: int = 0) -> nn.Module:
    from conftest import make_model

    torch.manual_seed(seed)
    return make_model("llama").eval()


def cached_equals_uncached(model: nn.Module) -> bool:
    ids = torch.randint(3, VOCAB, (1, 10))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
    return torch.equal(cached, uncached)


def reloads_with_the_same_logits(model: nn.Module, directory: Path) -> nn.Module:
    model.save_pretrained(directory)
    again = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(3, VOCAB, (1, 20))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, again(ids).logits, atol=1e-6)
    return again


LOADER = textwrap.dedent("""
    import sys
    sys.modules["hf_posswap"] = None  # not importable at all
    import torch, transformers
    data = torch.load(sys.argv[2])
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    with torch.no_grad():
        gap = (model(input_ids=data["input_ids"]).logits - data["expected"]).abs().max().item()
    print("EQUAL" if gap <= 1e-5 else f"DIFFERENT by {gap}")
    """)


def exports_standalone(model: nn.Module, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 3 of both walk-throughs: a new module is listed in ``BUNDLED`` (persistence/export.py), so the exported
    ``modeling_posswap.py`` carries it. Here the toy sources are appended to the bundle the same way."""
    toys = "\n\n".join(inspect.getsource(toy) for toy in (ToyDecayBias, ToyDecayConfig, OlmoAdapter))
    bundle = export_module.bundle_source
    monkeypatch.setattr(export_module, "bundle_source", lambda: f"{bundle()}\n\n{toys}\n\n{REGISTRATION}")
    ids = torch.randint(3, VOCAB, (1, 24))
    with torch.no_grad():
        torch.save({"input_ids": ids, "expected": model(input_ids=ids).logits}, directory.parent / "io.pt")
    ps.export_standalone(model, directory)
    result = subprocess.run([sys.executable, "-c", LOADER, str(directory), str(directory.parent / "io.pt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EQUAL" in result.stdout, result.stdout


# --- the scheme --------------------------------------------------------------------------------------------------


def test_a_new_scheme_swaps_trains_and_reloads(registered, tmp_path) -> None:
    model = tiny_llama()
    ps.swap(model, "toy_decay", rate=0.1)
    assert ps.describe(model).scheme == "toy_decay"
    assert "toy_decay" in ps.available_schemes()
    ids = torch.randint(3, VOCAB, (2, 16))
    model(ids, labels=ids).loss.backward()
    rate = next(p for name, p in model.named_parameters() if name.endswith("rate"))
    assert rate.grad is not None and rate.grad.abs().sum() > 0  # the new parameter trains
    with torch.no_grad():
        rate.copy_(torch.linspace(0.02, 0.2, rate.numel()))  # not the initial values: the reload must read them
    assert cached_equals_uncached(model)
    again = reloads_with_the_same_logits(model, tmp_path / "saved")
    assert ps.describe(again).scheme == "toy_decay"
    ps.unswap(again)


def test_a_new_scheme_refuses_bad_options_with_the_base_class_errors(registered) -> None:
    with pytest.raises(ps.InvalidConfigError, match="rate"):
        ToyDecayConfig(rate=-1.0)
    with pytest.raises(ps.InvalidOptionError, match="Its options are: rate"):
        ps.swap(tiny_llama(), "toy_decay", slope=0.1)


@pytest.mark.slow
def test_a_new_scheme_exports_standalone(registered, tmp_path, monkeypatch) -> None:
    model = tiny_llama()
    ps.swap(model, ToyDecayConfig(rate=0.07))
    exports_standalone(model, tmp_path / "export", monkeypatch)


def test_a_new_scheme_is_listed_by_the_cli(registered, capsys) -> None:
    assert main(["schemes"]) == 0
    listing = capsys.readouterr().out
    assert "toy_decay" in listing and "rate" in listing


# --- the family --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["toy_decay", "alibi", "rope"], ids=["new-scheme", "bias", "native-rope"])
def test_a_new_family_swaps_generates_and_reloads(registered, scheme, tmp_path) -> None:
    model = tiny_olmo()
    options = {"rope_theta": 500.0} if scheme == "rope" else {}
    ps.swap(model, scheme, **options)
    assert ps.describe(model).family == "olmo"
    assert cached_equals_uncached(model)
    again = reloads_with_the_same_logits(model, tmp_path / scheme)
    if scheme == "rope":  # native: a plain OLMo checkpoint, no hf_posswap model type
        assert type(again) is OlmoForCausalLM
    ps.unswap(model)


@pytest.mark.slow
def test_a_new_family_exports_standalone(registered, tmp_path, monkeypatch) -> None:
    model = tiny_olmo()
    ps.swap(model, "alibi")
    exports_standalone(model, tmp_path / "export", monkeypatch)


def test_a_new_family_is_listed_by_the_cli(registered, capsys) -> None:
    assert main(["schemes"]) == 0
    assert "| `olmo` |" in capsys.readouterr().out
    assert "olmo" in ps.supported_families()


def test_contributing_points_at_what_this_file_defines() -> None:
    """CONTRIBUTING.md names the toys and the tests of this file: a rename here must update the walk-through."""
    text = (Path(__file__).resolve().parent.parent / "CONTRIBUTING.md").read_text(encoding="utf-8")
    names = [ToyDecayBias, ToyDecayConfig, OlmoAdapter, registered, exports_standalone,
             test_a_new_scheme_swaps_trains_and_reloads, test_a_new_scheme_exports_standalone,
             test_a_new_scheme_is_listed_by_the_cli, test_a_new_family_swaps_generates_and_reloads,
             test_a_new_family_exports_standalone, test_a_new_family_is_listed_by_the_cli]
    missing = [thing.__name__ for thing in names if f"`{thing.__name__}`" not in text]
    assert not missing, f"CONTRIBUTING.md no longer names {missing}"
    for contract in ("BiasPositions", "SchemeConfig", "register_scheme", "register_family", "FamilyAdapter", "BUNDLED"):
        assert contract in text
