"""What the test_flex_bias_*.py files share: the bias schemes and families they swap in, the case matrix with its fast
cross-section, the fixture that lets the uncompiled flex run on CPU (``FLEX_DEVICES`` patched to include ``"cpu"``),
and the calls that run a model through flex or through the dense path (the eager carrier, always the dense bias)
and record which path each attention call took. Position parameters are randomised first: T5's zero tables and
FIRE's zero output layer would pass any code."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_model

import hf_posswap as ps
from hf_posswap.core import flex_bias
from hf_posswap.core.paths import record_paths

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
    "fire": lambda: ps.FireConfig(mlp_width=8, init_threshold=8.0),  # L inside the test rows: max(i, L) varies
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
