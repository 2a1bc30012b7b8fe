"""Bad per-layer and per-head mixes are refused with a clear error and leave the model as it was."""

from __future__ import annotations

import pytest
import torch
from mix_models import logits, make_model, tokens

import hf_posswap as ps
from hf_posswap.core.state import STATE_ATTR

BAD = {
    "out-of-range": (lambda: ps.LayerMix(default="rope", overrides={"none": [1, 4]}),
                     r"lists layers \[4\], but the model has 4 layers \(indices 0 to 3\)"),
    "overlap": (lambda: ps.LayerMix(default="rope", overrides=[("none", [1]), ("alibi", [2, 1])]),
                r"lists layer 1 twice \(in the overrides for 'none' and 'alibi'\)"),
    "nested": (lambda: ps.LayerMix(default=ps.LayerMix(), overrides={}), r"mixes do not nest"),
    "absolute-part": (lambda: ps.LayerMix(default="rope", overrides={"learned": [0]}),
                      r"'learned', an absolute scheme: absolute schemes add their vectors once"),
    "layers-as-keys": (lambda: ps.LayerMix(default="rope", overrides={1: "alibi"}),
                       r"entry \(1, 'alibi'\) is \(layer, scheme\).*overrides=\{'alibi': \[1\]\}"),
    "not-an-index": (lambda: ps.LayerMix(default="rope", overrides={"none": [1.5]}), r"not valid: \[1.5\]"),
    "negative-floor-scale": (lambda: ps.LayerMix(overrides={"none": [1]}, attn_temperature_tuning=True,
                                                 floor_scale=-1), r"LayerMix.floor_scale must be a finite number > 0"),
    "nan-attn-scale": (lambda: ps.LayerMix(overrides={"none": [1]}, attn_temperature_tuning=True,
                                           attn_scale=float("nan")), r"LayerMix.attn_scale must be a finite number"),
    "temperature-without-nope": (lambda: ps.LayerMix(default="rope", attn_temperature_tuning=True),
                                 r"this mix has no 'none' layer"),
    "head-split-across-kv-group": (lambda: ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[1, 2]),
                                   r"splits key/value groups \[\[0, 1\], \[2, 3\]\].*e\.g\. bias_heads=\[0, 1, 2, 3\]"),
    "head-mix-every-head-bias": (lambda: ps.HeadMix(bias_heads=[0, 1, 2, 3]), r"covers every head, leaving none"),
    "head-mix-rotary-as-bias": (lambda: ps.HeadMix(bias="rope"), r"HeadMix.bias must be a bias scheme"),
    "head-out-of-range": (lambda: ps.LayerMix(overrides=[(ps.HeadMix(bias_heads=[4, 5]), [0])]),
                          r"lists heads \[4, 5\], but the model has 4 attention heads"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_mixes_are_refused_and_leave_the_model_unchanged(case: str) -> None:
    build, message = BAD[case]
    model = make_model("llama")
    ps.swap(model, "alibi")  # an earlier swap must survive a refused replacement
    before, keys = logits(model, tokens(1, 12)), list(model.state_dict())
    with pytest.raises(ps.InvalidConfigError, match=message):
        ps.swap(model, build(), replace=True)
    assert ps.describe(model).scheme == "alibi" and list(model.state_dict()) == keys
    assert torch.equal(logits(model, tokens(1, 12)), before)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_layers_shorthand_on_absolute_models_is_refused(family: str) -> None:
    model = make_model(family)
    with pytest.raises(ps.InvalidConfigError, match=r"not a per-layer mechanism.*LayerMix\(default='rope'"):
        ps.swap(model, "none", layers=[1])
    assert getattr(model, STATE_ATTR, None) is None


BAD_TEMPERATURE = {
    "floor_scale-none": {"floor_scale": None},
    "floor_scale-list": {"floor_scale": [8192]},
    "attn_scale-str": {"attn_scale": "0.1"},
}


@pytest.mark.parametrize("options", list(BAD_TEMPERATURE.values()), ids=list(BAD_TEMPERATURE))
def test_layer_mix_temperature_setting_of_wrong_type_is_refused(options: dict) -> None:
    (name, value), = options.items()
    with pytest.raises(ps.errors.InvalidConfigError, match=rf"LayerMix\.{name} must be a finite number") as caught:
        ps.LayerMix(default="rope", overrides={"none": [1]}, attn_temperature_tuning=True, **options)
    assert repr(value) in str(caught.value)
