"""A part of a swapped model (``model.base_model``) shares its config but not its swap: hf_posswap's calls on the
part say to use the whole model, instead of claiming the checkpoint was loaded as the wrong model."""

from __future__ import annotations

import pytest
from conftest import make_model, swapped
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_posswap as ps

CALLS = {
    "describe": ps.describe,
    "unswap": ps.unswap,
    "extend": lambda part: ps.extend_context(part, 200),
    "swap": lambda part: ps.swap(part, "alibi", replace=True),
}


@pytest.mark.parametrize("call", list(CALLS), ids=list(CALLS))
@pytest.mark.parametrize(("family", "auto"), [("bert", AutoModelForMaskedLM), ("gpt2", AutoModelForCausalLM)],
                         ids=["bert", "gpt2"])
def test_calls_on_the_base_model_of_a_swapped_model_name_the_whole_model(tmp_path, family, auto, call) -> None:
    model = swapped(family, "t5")
    model.save_pretrained(tmp_path)
    for whole in (model, auto.from_pretrained(tmp_path)):
        with pytest.raises(ps.NotSwappedError, match=r"is a part of a model that hf_posswap swapped .* not on its "
                           r"base_model"):
            CALLS[call](whole.base_model)
        assert ps.describe(whole).scheme == "t5"  # the whole model is untouched and still answers


def test_a_plain_model_part_is_not_affected() -> None:
    model = make_model("bert")
    assert ps.describe(model.base_model).scheme == "native"
    ps.swap(model.base_model, "alibi")  # swapping a part of a plain model is allowed: the part holds the swap
    assert ps.describe(model.base_model).scheme == "alibi"
