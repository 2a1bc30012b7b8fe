"""One rank of the context-parallel checks (tests/core/test_context_parallel.py starts several over gloo).

Every rank builds the same tiny swapped model, runs the whole sequence in one process (the reference), then its own
shard under ``hf_posswap.context_parallel``; it compares its shard's logits with the reference's and the all-reduced
gradients (position parameters and one weight matrix) with the reference's, and prints one JSON line per case.

A case [name, padded, "gapped"] passes PoSE-like position ids (each row 0..k, then a jump): every rank its shard's
slice of them, the reference the whole, with an attention_mask (all ones when unpadded, as training batches carry
one: without it a causal transformers model reads the jump as the start of a packed sequence). One process ignores
position ids in a padded batch (it uses index distances), so with padding the reference runs each row's real tokens
alone, with their position ids.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, where conftest lives

from conftest import MAX_POSITIONS, make_model, swapped  # noqa: E402

import hf_posswap as ps  # noqa: E402
from hf_posswap.core.paths import record_paths  # noqa: E402

LENGTH = 40  # split unevenly across 3 ranks (14, 13, 13)
WINDOW = 8


def self_extend(family: str) -> torch.nn.Module:
    model = make_model(family)
    with torch.no_grad():  # sharper queries and keys, so that grouping moves the logits clearly
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                parameter.mul_(4)
    if family == "bert":
        ps.swap(model, "rope")
    return ps.extend_context(model, 2 * MAX_POSITIONS, "self_extend", neighbor_window=WINDOW, group_size=4)


def mixed(family: str) -> torch.nn.Module:
    model = make_model(family)
    t5 = ps.T5BiasConfig(num_buckets=16, max_distance=32)
    return ps.swap(model, ps.LayerMix(default=ps.HeadMix(bias="alibi", rotary="rope", bias_heads=[2, 3]),
                                      overrides=[(t5, [1])]))


def irope() -> torch.nn.Module:
    """Llama 4's layout: RoPE layers and NoPE layers with a query temperature that grows with the position."""
    model = make_model("llama")
    return ps.swap(model, ps.llama4_irope(model, no_rope_layer_interval=2, floor_scale=4))


def checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    """Gradient checkpointing (transformers' own, in training mode): the backward runs every ring forward again."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    return model


CASES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama-xpos": lambda: swapped("llama", "xpos"),  # rotary with a key scale: one reference for every shard
    "bert-rope": lambda: swapped("bert", "rope"),
    **{f"{family}-{scheme}": (lambda f=family, s=scheme: swapped(f, s))
       for family in ("llama", "bert") for scheme in ("alibi", "t5", "kerple", "fire")},
    "llama-layer-mix": lambda: mixed("llama"),
    "bert-layer-mix": lambda: mixed("bert"),
    "llama-irope": lambda: irope(),
    "gpt2-alibi": lambda: swapped("gpt2", "alibi"),
    "llama-checkpointed-t5": lambda: checkpointed(swapped("llama", "t5")),
    "llama-self-extend": lambda: self_extend("llama"),
    "bert-self-extend": lambda: self_extend("bert"),
}


def inputs(family: str, padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Two rows; with ``padded``, the first row padded (left in a causal model, right in BERT)."""
    ids = torch.randint(3, 90, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    if not padded:
        return ids, None
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if family == "bert":
        mask[0, -11:] = 0
    else:
        mask[0, :11] = 0
    return ids, mask


def gapped_positions(mask: torch.Tensor | None) -> torch.Tensor:
    """PoSE-like position ids [2, LENGTH]: each row's real tokens at 0..k, then a jump (k and the jump differ per row),
    padding at 1 (as ``generate`` puts it); the largest stays below the test models' position tables."""
    real = torch.ones(2, LENGTH, dtype=torch.long) if mask is None else mask.long()
    count = real.cumsum(-1) - 1  # [2, LENGTH]: the real tokens' order
    jump = torch.where(count >= torch.tensor([[9], [23]]), torch.tensor([[17], [21]]), 0)
    return torch.where(real.bool(), count + jump, 1)


def reference_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None,
                     positions: torch.Tensor | None, weights: torch.Tensor) -> torch.Tensor:
    """One process's logits [2, LENGTH, V], with its loss's backward run: the whole batch, or each row's real tokens
    alone when position ids meet padding."""
    if positions is None or mask is None or bool(mask.all()):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        keep = torch.ones(2, LENGTH, 1) if mask is None else mask[..., None].float()
        (logits * weights * keep).sum().backward()
        return logits
    logits = torch.zeros(2, LENGTH, model.config.vocab_size)
    for row in range(2):
        real = mask[row].bool()
        alone = model(input_ids=ids[row : row + 1, real], attention_mask=mask[row : row + 1, real],
                      position_ids=positions[row : row + 1, real], use_cache=False).logits  # [1, n, V]
        (alone * weights[row : row + 1, real]).sum().backward()
        logits[row, real] = alone[0].detach()
    return logits


def run_case(name: str, padded: bool, rank: int, world: int, gapped: bool = False) -> dict[str, Any]:
    family = name.split("-")[0]
    model = CASES[name]()
    if not model.training or "checkpointed" not in name:
        model.eval()
    ids, mask = inputs(family, padded)
    if gapped and mask is None:
        mask = torch.ones(2, LENGTH, dtype=torch.long)
    positions = gapped_positions(mask) if gapped else None
    weights = torch.randn(2, LENGTH, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, LENGTH, 1) if mask is None else mask[..., None].float()  # loss over real tokens only
    checked = _checked_parameters(model)

    reference = reference_logits(model, ids, mask, positions, weights)
    expected = [p.grad.clone() for p in checked]
    model.zero_grad()

    bounds = _bounds(world)
    start, end = bounds[rank], bounds[rank + 1]
    with ps.context_parallel(model), record_paths() as paths:
        local = model(input_ids=ids[:, start:end], attention_mask=None if mask is None else mask[:, start:end],
                      position_ids=None if positions is None else positions[:, start:end], use_cache=False).logits
    (local * weights[:, start:end] * keep[:, start:end]).sum().backward()
    logits_error = ((local - reference[:, start:end]) * keep[:, start:end]).abs().max().item()
    grad_errors = []
    for parameter, want in zip(checked, expected, strict=True):
        grad = parameter.grad.clone()
        dist.all_reduce(grad)
        # relative to the largest entry, absolute below 1 (a constant bias per head has a zero gradient: noise)
        grad_errors.append(((grad - want).abs().max() / want.abs().max().clamp(min=1.0)).item())
    return {"case": name, "padded": padded, "gapped": gapped, "rank": rank, "logits": logits_error,
            "grads": grad_errors, "paths": sorted(set(paths)), "position_parameters": len(checked) - 1}


def _checked_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The position scheme's trainable parameters and the first layer's query projection weight."""
    positions = getattr(model.base_model, "posswap_positions", None)
    own = [p for p in positions.parameters() if p.requires_grad] if positions is not None else []
    names = ("q_proj.weight", "query.weight", "c_attn.weight")
    query = next(p for n, p in model.named_parameters() if n.endswith(names))
    return [*own, query]


def _bounds(world: int) -> list[int]:
    """Uneven contiguous shards: the first rank takes the remainder."""
    base, extra = divmod(LENGTH, world)
    sizes = [base + extra] + [base] * (world - 1)
    return [sum(sizes[:r]) for r in range(world + 1)]


def run_other_swaps(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 swaps ALiBi, the others T5: one forward under ``context_parallel``, and what each rank raised."""
    model = swapped("llama", "alibi" if rank == 0 else "t5").eval()
    ids, _ = inputs("llama", padded=False)
    bounds = _bounds(world)
    try:
        with ps.context_parallel(model):
            model(input_ids=ids[:, bounds[rank] : bounds[rank + 1]], use_cache=False)
    except ps.InvalidConfigError as error:
        return {"case": OTHER_SWAPS, "rank": rank, "refused": str(error)}
    return {"case": OTHER_SWAPS, "rank": rank, "refused": None}


#: the case whose ranks hold models swapped to different schemes
OTHER_SWAPS = "other-swaps"


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    cases = json.loads(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, padded, *gapped in cases:
            if name == OTHER_SWAPS:
                print(json.dumps(run_other_swaps(rank, world)), flush=True)
                continue
            print(json.dumps(run_case(name, padded, rank, world, gapped == ["gapped"])), flush=True)
        dist.barrier()  # no process tears its connections down while another still works
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
