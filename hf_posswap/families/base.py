"""Family adapters: *where* a position scheme goes inside one model architecture.

An adapter knows, for one family: where the absolute table sits, where native rotary is computed (if anywhere),
which attention modules are self-attention, head counts and dims, and input fix-ups. It holds no scheme logic.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import nn

from ..edits import Edit, SetAttribute
from ..errors import UnsupportedFamilyError
from ..registry import Registry
from ..schemes.base import ModelSpec, NoPositions
from ..schemes.rope import RopeConfig
from ..schemes.two_pass import TwoPassScaling
from ..transformers_internals import ROPE_PARAMETERS, config_rope_parameters


class FamilyAdapter:
    """Base adapter; subclasses set ``name``, ``model_types`` and override the slots they have."""

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    native_positions: ClassVar[str] = ""
    #: attention projections LoRA targets by default
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    #: dotted path, under the base model, of the learned absolute table (None: the family has none)
    absolute_table_path: ClassVar[str | None] = None
    #: dotted path, under the base model, of the native rotary module (None: the family has none)
    rotary_module_path: ClassVar[str | None] = None
    #: how a RoPE swap is carried when the family has a rotary module (the README's support matrix cell)
    native_rope_support: ClassVar[str] = "native: config.rope_parameters (partial: in attention)"

    def prepare_checkpoints(self) -> None:
        """Register with transformers what swapped checkpoints of this family need to save and load (e.g. weight
        renamings). Runs when a model of the family is swapped and before a swapped checkpoint's class first loads,
        not at import: it may import heavy parts of transformers. Idempotent; nothing by default."""

    # --- structure --------------------------------------------------------------------------------------------
    def base_model(self, model: nn.Module) -> nn.Module:
        """The transformer body (``GPT2Model``, ``BertModel``, ``LlamaModel``) whose forward the position wrapper
        stands in for."""
        return getattr(model, "base_model", model)

    def absolute_slot(self, base: nn.Module) -> tuple[nn.Module, str] | None:
        """(parent, attribute) of the learned absolute table, or ``None`` when the family has none."""
        return _slot(base, self.absolute_table_path)

    def rotary_slot(self, base: nn.Module) -> tuple[nn.Module, str] | None:
        """(parent, attribute) of the native rotary module, or ``None`` when the family has none."""
        return _slot(base, self.rotary_module_path)

    def is_self_attention(self, module: nn.Module) -> bool:
        """Whether an attention module is self-attention (schemes never touch cross-attention)."""
        return not getattr(module, "is_cross_attention", False)

    def is_causal(self, config: Any) -> bool:
        """Whether the family's self-attention is causal for this config."""
        return True

    def spec(self, model: nn.Module) -> ModelSpec:
        """Model facts read through transformers' standard config names (``attribute_map`` covers GPT-2's)."""
        config = model.config
        base = self.base_model(model)
        dtype, device = parameter_dtype_device(base)
        slot = self.absolute_slot(base)
        table = getattr(getattr(slot[0], slot[1]), "weight", None) if slot is not None else None
        rope = config_rope_parameters(config) if self.rotary_module_path else {}
        heads = config.num_attention_heads
        return ModelSpec(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            is_causal=self.is_causal(config),
            max_positions=getattr(config, "max_position_embeddings", None),
            initializer_range=getattr(config, "initializer_range", 0.02),
            native_rope_theta=rope.get("rope_theta"),
            dtype=dtype,
            device=device,
            existing_table=table,
        )

    # --- scheme support ----------------------------------------------------------------------------------------
    def native_rope_edits(self, model: nn.Module, config: RopeConfig) -> list[Edit] | None:
        """Edits that express ``config`` through the model's own rotary machinery, or ``None`` when the family
        cannot (the scheme is then applied inside attention)."""
        return None

    def removal_edits(self, model: nn.Module, spec: ModelSpec, keep_absolute_slot: bool = False) -> list[Edit]:
        """Edits that silence the family's native position mechanism: the absolute table returns zeros and the
        rotary module returns cos = 1, sin = 0. Both are exact no-ops. ``keep_absolute_slot`` leaves the table
        slot alone (an absolute scheme is about to fill it)."""
        base = self.base_model(model)
        edits: list[Edit] = []
        if not keep_absolute_slot and (slot := self.absolute_slot(base)) is not None:
            parent, attr = slot
            edits.append(
                SetAttribute(
                    parent,
                    attr,
                    lambda: NoPositions(spec.hidden_size).to(device=spec.device, dtype=spec.dtype),
                    where=f"{attr} <- NoPositions (native absolute table removed)",
                )
            )
        if (slot := self.rotary_slot(base)) is not None:
            parent, attr = slot
            edits.append(
                SetAttribute(
                    parent,
                    attr,
                    lambda: IdentityRotary(spec.head_dim),
                    where=f"{attr} <- IdentityRotary (native RoPE removed)",
                )
            )
        return edits

    def length_edits(self, model: nn.Module, max_positions: int) -> list[Edit]:
        """Edits that let the model take ``max_positions`` tokens: ``config.max_position_embeddings`` and any
        position-sized buffers (BERT's). Used by ``extend_context``."""
        return [
            SetAttribute(
                model.config,
                "max_position_embeddings",
                lambda: max_positions,
                where=f"config.max_position_embeddings = {max_positions}",
            )
        ]

    def absolute_position_ids(self, base: nn.Module, kwargs: dict[str, Any], query_offset: int) -> torch.Tensor | None:
        """Position ids [B or 1, L] for absolute vectors the position wrapper adds itself (no table slot, or
        ``combine="concat"``) when the caller passed none; ``None``: the default ``offset .. offset + L - 1``."""
        return None

    def first_position_id(self, base: nn.Module) -> int:
        """The position id this family numbers a sequence's first token with (RoBERTa: ``padding_idx + 1``).
        Schemes inside attention read explicit ``position_ids`` counted from 0, as a sequence alone is placed."""
        return 0

    def prepare_inputs(self, base: nn.Module, kwargs: dict[str, Any], query_offset: int) -> None:
        """Family fix-ups to the base model's forward kwargs, run by the position wrapper before every forward."""

    def describe_native(self, model: nn.Module) -> str:
        return self.native_positions


class IdentityRotary(nn.Module):
    """Stands in for a LLaMA-like rotary module: cos = 1 and sin = 0, so ``apply_rotary_pos_emb`` returns q, k
    unchanged (bit for bit: x·1 + rotate_half(x)·0 = x)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, L] -> cos, sin [B, L, head_dim]; ``layer_type``: Gemma 3 asks per layer type (same answer)
        shape = (*position_ids.shape, self.head_dim)
        cos = torch.ones(shape, dtype=x.dtype, device=x.device)
        return cos, torch.zeros_like(cos)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"


FAMILY_REGISTRY: Registry[FamilyAdapter] = Registry(
    "model family", UnsupportedFamilyError, "List them with hf_posswap.supported_families()."
)


def register_family(cls: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Class decorator: register one adapter instance under each of its ``model_types``."""
    adapter = cls()
    for model_type in cls.model_types:
        FAMILY_REGISTRY.register(model_type)(adapter)
    return cls


def get_family(model: nn.Module) -> FamilyAdapter:
    """The adapter for ``model.config.model_type``, or an error naming the type and listing supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "posswap_base_model_type", None) or getattr(config, "model_type", None)
    if model_type is None:
        inner = getattr(model, "module", None)  # DataParallel, DistributedDataParallel, accelerate's wrappers
        wrapped = (f" It wraps a {type(inner).__name__} in .module: pass that (swap(model.module, ...)), or swap "
                   "before wrapping." if getattr(getattr(inner, "config", None), "model_type", None) else "")
        raise UnsupportedFamilyError(
            f"{type(model).__name__} has no `config.model_type`; hf_posswap works on Hugging Face transformers "
            f"models. Supported families: {', '.join(FAMILY_REGISTRY.names())}.{wrapped}"
        )
    if model_type not in FAMILY_REGISTRY:
        raise UnsupportedFamilyError(
            f"Model family '{model_type}' ({type(model).__name__}) is not supported. Supported families: "
            f"{', '.join(FAMILY_REGISTRY.names())}. A LLaMA-like decoder can be added by registering a "
            "FamilyAdapter for its model_type."
        )
    return FAMILY_REGISTRY.get(model_type)


def rebuild_rotary_edits(model: nn.Module, base: nn.Module, rope_parameters: dict[str, Any]) -> list[Edit]:
    """Write ``config.rope_parameters`` and rebuild ``base.rotary_emb`` from the model's own rotary class: exactly
    the model transformers builds from that config, so the result saves and reloads without hf_posswap."""
    rotary_cls = type(base.rotary_emb)
    device = next(iter(base.rotary_emb.buffers())).device
    return [
        SetAttribute(
            model.config,
            ROPE_PARAMETERS,
            lambda: copy.deepcopy(rope_parameters),
            where=f"config.rope_parameters = {rope_parameters}",
        ),
        SetAttribute(
            base,
            "rotary_emb",
            lambda: rotary_cls(config=model.config).to(device),
            where=f"rotary_emb <- {rotary_cls.__name__} rebuilt from config.rope_parameters",
        ),
    ]


def native_partial_rope_edits(
    model: nn.Module, base: nn.Module, config: RopeConfig, head_dim: int, rope_types: tuple[str, ...] | None = None
) -> list[Edit] | None:
    """Native RoPE edits for families whose own ``apply_rotary_pos_emb`` rotates the first ``cos.shape[-1]`` dims
    and whose rotary class reads ``rope_parameters["partial_rotary_factor"]`` (Phi-3, GPT-NeoX). ``None`` when the
    family cannot express ``config``: Self-Extend (needs unrotated cached keys), a rope type outside ``rope_types``,
    or an odd rotated width (transformers would round it up, hf_posswap rounds it down)."""
    if isinstance(config.scaling, TwoPassScaling):
        return None
    if int(head_dim * config.partial_rotary_factor) % 2:
        return None
    rope_parameters = config.rope_parameters(head_dim)
    if rope_types is not None and rope_parameters["rope_type"] not in rope_types:
        return None
    # written even at 1.0: GPT-NeoX's config fills a missing factor with 0.25 (rotary_pct's default) on reload
    rope_parameters["partial_rotary_factor"] = float(config.partial_rotary_factor)
    return rebuild_rotary_edits(model, base, rope_parameters)


def _slot(base: nn.Module, path: str | None) -> tuple[nn.Module, str] | None:
    if path is None:
        return None
    parent_path, _, attr = path.rpartition(".")
    return (base.get_submodule(parent_path) if parent_path else base), attr


def parameter_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """dtype and device of a module's first floating-point parameter."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype, param.device
    return torch.get_default_dtype(), torch.device("cpu")


def default_position_ids(length: int, query_offset: int, device: torch.device) -> torch.Tensor:
    """[1, L] positions ``offset .. offset+L-1`` (what the models use when no position ids are passed)."""
    return (torch.arange(length, device=device) + query_offset).unsqueeze(0)
