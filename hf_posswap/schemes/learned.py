"""Learned absolute position table (GPT-2, BERT; Radford et al. 2019, Devlin et al. 2019)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import (
    FRESH_MARK,
    AbsolutePositions,
    ConcatPositions,
    ModelSpec,
    NativeWeightsMissingWarning,
    SchemeConfig,
    register_scheme,
    require_bool,
    require_combine,
    require_int_at_least,
)

MAX_TABLE_POSITIONS = 2**24


class LearnedPositions(AbsolutePositions):
    """A trainable table ``weight[max_positions, hidden]`` looked up by position id.

    Unlike ``nn.Embedding`` it fails with a message that says how to grow the table when a position is past its end.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    @property
    def max_positions(self) -> int:
        return self.weight.shape[0]

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        # [B, L] -> [B, L, hidden]
        if position_ids.numel() and torch.compiler.is_compiling():
            # reading the largest position on the host would break the graph once per forward; the check runs in
            # the graph instead (on a GPU asynchronously, as nn.Embedding's own index check does there)
            torch._assert_async(position_ids.max() < self.max_positions, self._past_the_end("A position"))
        elif position_ids.numel() and int(position_ids.max()) >= self.max_positions:
            raise IndexError(self._past_the_end(f"Position {int(position_ids.max())}"))
        return nn.functional.embedding(position_ids, self.weight)

    def _past_the_end(self, which: str) -> str:
        return (
            f"{which} is past the end of the learned position table ({self.max_positions} positions). Grow it with "
            "hf_posswap.swap(model, LearnedConfig(max_positions=...)) or use a scheme without a length limit."
        )

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, hidden_size={self.weight.shape[1]}"


@register_scheme
@dataclass
class LearnedConfig(SchemeConfig):
    """A learned absolute table added to the token embeddings.

    Args:
        max_positions: table length. ``None`` keeps the model's current table length (or
            ``config.max_position_embeddings`` for a model without a table). A larger value grows the table;
            the new rows are drawn from N(0, initializer_range) like a fresh table.
        keep_weights: when the model already has a learned table, start from a copy of its weights (default).
            ``False`` draws a fresh table.
        combine: ``"add"`` (default) adds the table's vectors to the token embeddings; ``"concat"`` concatenates
            them and projects back to the hidden size with a learned map that starts as plain addition
            (:class:`~hf_posswap.schemes.base.ConcatPositions`), so the swapped model starts where ``"add"`` does.
    """

    name = "learned"
    kind = "absolute"
    paper = "Radford et al. 2019 (GPT-2); Devlin et al. 2019 (BERT)"

    max_positions: int | None = None
    keep_weights: bool = True
    combine: str = "add"

    def validate(self) -> None:
        if self.max_positions is not None:
            require_int_at_least("LearnedConfig", "max_positions", self.max_positions, 1)
            if self.max_positions > MAX_TABLE_POSITIONS:
                raise InvalidConfigError(
                    f"LearnedConfig.max_positions={self.max_positions} is past {MAX_TABLE_POSITIONS} (2^24), the last "
                    "position float32 holds exactly; such a table would not fit in memory either. Use a smaller "
                    "length, or a scheme without a table (rope, alibi, t5)."
                )
        require_bool("LearnedConfig", "keep_weights", self.keep_weights)
        require_combine("LearnedConfig", self.combine)

    def resolve(self, spec: ModelSpec) -> LearnedConfig:
        current = spec.existing_table.shape[0] if spec.existing_table is not None else spec.max_positions
        if self.max_positions is None and current is None:
            raise InvalidConfigError(
                f"LearnedConfig.max_positions is None and the {spec.model_type} model declares no maximum length; "
                "pass LearnedConfig(max_positions=N)."
            )
        max_positions = self.max_positions if self.max_positions is not None else current
        keep = self.keep_weights and spec.existing_table is not None
        if keep and max_positions < spec.existing_table.shape[0]:
            raise InvalidConfigError(
                f"LearnedConfig.max_positions={max_positions} would shrink the model's learned table of "
                f"{spec.existing_table.shape[0]} positions; pass a value >= {spec.existing_table.shape[0]} "
                "or keep_weights=False for a fresh table."
            )
        return LearnedConfig(max_positions=max_positions, keep_weights=keep, combine=self.combine)

    def build(self, spec: ModelSpec) -> LearnedPositions | ConcatPositions:
        if self.max_positions is None:  # not resolved yet: fill model-dependent defaults first
            return self.resolve(spec).build(spec)
        weight = torch.empty(self.max_positions, spec.hidden_size, dtype=spec.dtype, device=spec.device)
        nn.init.normal_(weight, mean=0.0, std=spec.initializer_range)
        if self.keep_weights and spec.existing_table is not None:
            if getattr(spec.existing_table, FRESH_MARK, False):
                warnings.warn(
                    "LearnedConfig(keep_weights=True) starts from the model's native position table, which this "
                    "reloaded swapped checkpoint did not hold: it is transformers' random initialisation, not "
                    "trained weights. Load the original checkpoint to keep its trained table.",
                    NativeWeightsMissingWarning,
                    stacklevel=6,
                )
            kept = spec.existing_table.shape[0]
            weight[:kept] = spec.existing_table.detach().to(dtype=spec.dtype, device=spec.device)
        if self.combine == "concat":
            return ConcatPositions(LearnedPositions(weight), spec.hidden_size).to(dtype=spec.dtype, device=spec.device)
        return LearnedPositions(weight)
