"""GPT-NeoX (Pythia): fused ``query_key_value`` projection, parallel residual (attention and MLP read the same
input; positions only enter attention, so nothing here depends on it) and partial rotary (``rotary_pct``, kept by
transformers 5.x as ``rope_parameters["partial_rotary_factor"]``, 0.25 by default: the first quarter of each head
is rotated, the rest passes through). One rotary module at ``gpt_neox.rotary_emb`` applied before the cache update.

RoPE swaps are written natively (``rope_parameters`` + the rotary class rebuilt) for every rope type; the rotated
fraction is always written, since ``GPTNeoXConfig`` fills a missing one with 0.25 on reload.

Checkpoints: transformers saves GPT-NeoX's head as ``embed_out`` and renames it to ``lm_head`` on load, looking the
renaming up by class name, then by ``model_type``. A swapped model saves as ``hf_posswap_gpt_neox`` and reloads into
hf_posswap's subclass, which neither name finds: the head would come back random. The same renaming is registered
for that model type.
"""

from __future__ import annotations

from torch import nn

from ..edits import Edit
from ..schemes.rope import RopeConfig
from ..transformers_internals import config_rope_parameters, share_checkpoint_renamings
from .base import FamilyAdapter, native_partial_rope_edits, register_family

#: model_type of a non-native swapped GPT-NeoX checkpoint (``hf_posswap.core.state.MODEL_TYPE_PREFIX`` + gpt_neox)
SWAPPED_MODEL_TYPE = "hf_posswap_gpt_neox"


def _share_head_renaming() -> None:
    """Register transformers' own GPT-NeoX checkpoint renamings (``embed_out`` -> ``lm_head``) for swapped
    checkpoints too (idempotent)."""
    share_checkpoint_renamings("GPTNeoXForCausalLM", SWAPPED_MODEL_TYPE)


@register_family
class GPTNeoXAdapter(FamilyAdapter):
    name = "gpt_neox"
    model_types = ("gpt_neox",)
    native_positions = "partial RoPE (gpt_neox.rotary_emb, config.rope_parameters)"
    lora_target_modules = ("query_key_value", "dense")
    rotary_module_path = "rotary_emb"

    native_rope_support = "native: config.rope_parameters, partial too"

    def prepare_checkpoints(self) -> None:
        _share_head_renaming()

    def native_rope_edits(self, model: nn.Module, config: RopeConfig) -> list[Edit] | None:
        return native_partial_rope_edits(model, self.base_model(model), config, self.spec(model).head_dim)

    def describe_native(self, model: nn.Module) -> str:
        return f"partial RoPE (rotary_emb, rope_parameters={config_rope_parameters(model.config)})"
