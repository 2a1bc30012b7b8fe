"""The README's support matrix (generated from the registries) agrees with what swap actually does."""

from __future__ import annotations

import pytest
from conftest import FAMILIES, SCHEMES, make_model, refuses, swapped

import hf_posswap as ps
from hf_posswap.cli.matrix import LEGEND, support_cell
from hf_posswap.errors import InvalidConfigError


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_cell_says_what_swap_does(family: str, scheme: str) -> None:
    cell = support_cell(family, scheme)
    assert cell == "yes" or cell in LEGEND
    description = ps.describe(swapped(family, scheme))
    if description.native:  # saved as transformers' own rope_parameters: the cell must say so
        assert cell == "native", (family, scheme, cell)
    else:
        assert cell != "encoders refused"


def test_a_native_cell_and_an_attention_cell() -> None:
    assert support_cell("llama", "rope") == "native" and support_cell("gpt2", "rope") == "attention"
    assert support_cell("bert", "xpos") == "encoders refused" and support_cell("llama", "xpos") == "attention"


@pytest.mark.parametrize("family", [f for f in FAMILIES if refuses(f, "xpos")])
def test_refused_cells_are_refused(family: str) -> None:
    assert support_cell(family, "xpos") == "encoders refused"
    with pytest.raises(InvalidConfigError, match="causal"):
        ps.swap(make_model(family), "xpos")
