"""A training step under ``torch.compile(fullgraph=True)``: one graph, and the loss and every gradient of eager.

Schemes that rotate queries and keys inside attention (RoPE and xPos on GPT-2 and BERT, head mixes on LLaMA) go
through the pair-wise rotation's autograd Function (:mod:`hf_posswap.core.rotation`), whose eager form writes into
strided views and loops over blocks of positions; compiled, it is one block written out of place. Learned tables and
xPos check their ranges inside the graph. Checked with dynamo's ``eager`` backend (its tracing and guards; inductor
would add code generation, not other graphs).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import VOCAB, make_model, swapped

import hf_posswap as ps

CASES = [("gpt2", "rope"), ("bert", "rope"), ("gpt2", "xpos"), ("llama", "xpos"), ("llama", "head_mix"),
         ("llama", "learned"), ("gpt2", "learned")]


def _model(family: str, scheme: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if scheme == "head_mix":
        model = make_model(family)
        ps.swap(model, ps.HeadMix(bias="alibi", rotary="rope"))
        return model
    return swapped(family, scheme)


def _loss_and_gradients(model: torch.nn.Module, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    output = forward(input_ids=ids, attention_mask=torch.ones_like(ids))
    loss = output.logits.float().logsumexp(-1).mean()  # every family (BERT has no causal-LM labels)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("family", "scheme"), [pytest.param(f, s, id=f"{f}-{s}") for f, s in CASES])
def test_a_compiled_training_step_is_one_graph_with_eager_gradients(family: str, scheme: str) -> None:
    model = _model(family, scheme).train()
    want_loss, want = _loss_and_gradients(model, model.forward)
    torch._dynamo.reset()
    try:
        got_loss, got = _loss_and_gradients(model, torch.compile(model.forward, backend="eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, name=name: f"{name}: {m}")
