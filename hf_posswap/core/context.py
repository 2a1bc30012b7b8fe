"""The per-forward position context, and the wrapper of the base model's ``forward`` that provides it.

The wrapper (:class:`PositionForward`) replaces ``forward`` on the base model instance (``GPT2Model``,
``BertModel``, ``LlamaModel``). Before each forward it reads the query offset from the KV cache, applies the
family's input fix-ups, adds absolute vectors for families without a table slot, and passes a
:class:`PositionContext` down to the attention function as a keyword argument (transformers forwards unknown
kwargs from the base model to every attention call). The position module is looked up on the base model by
attribute at call time, so peft's ``modules_to_save`` copies are the ones used.

Why a ``forward`` wrapper and not a forward pre-hook: a pre-hook runs only through ``module(...)``. Clients such
as sentence-transformers call ``model.forward(**features)`` directly, which skips every hook and would silently
run the model without its positions. Every path into the base model — ``model(...)``, ``model.forward(...)``,
``model.base_model.forward(...)``, the head model's ``self.model(...)``, ``generate()``, peft wrappers — ends in
``base.forward``, so the context is built there. The wrapper is a plain picklable object that holds the base
model, so ``copy.deepcopy`` rebinds it to the copy, and it calls the class's own ``forward`` unless another
library (accelerate's hooks) had already wrapped ``forward`` at swap time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..errors import IncompatibleAttentionError, InvalidConfigError
from ..families.base import FamilyAdapter, default_position_ids
from ..schemes.two_pass import TwoPassSettings
from ..transformers_internals import (
    CACHE_KWARG,
    attention_implementation,
    cache_length,
    find_cache,
    self_attention_layers,
)
from .forward_check import ForwardCheck, new_tokens
from .forward_memo import CompiledMemo, ForwardMemo, new_memo
from .input_positions import (
    check_attention_mask,
    check_position_ids,
    counted_from_zero,
    explicit_positions,
    padded_positions,
    reads_query_positions,
    row_shifts,
)
from .layer_plan import LayerPlan
from .offload import onloaded
from .rotary_cache import MARKER, refuse_foreign_rotation, rotates_once

CONTEXT_KWARG = "posswap_context"
POSITIONS_ATTR = "posswap_positions"


#: what a context asks of attention (``core/attention.py``'s ``scheme_inputs`` dispatches on it): a scheme config's
#: kind ("absolute": positions already in the embeddings, "rotary", "bias", "none"), "temperature" (queries scaled
#: by position only), "head_mix" (per-head schemes in one layer) or "mix" (a layer mix, before ``for_layer`` picks
#: the layer's part)
ContextKind = Literal["absolute", "rotary", "bias", "none", "temperature", "head_mix", "mix"]


@dataclass
class PositionContext:
    """What the attention function needs to place queries and keys.

    ``query_offset`` is the number of tokens in the cache before this forward. Keys are indexed so that relative
    distances are index differences: a left-padded row then sees the same distances as the row alone.
    """

    positions: nn.Module | None
    kind: ContextKind
    query_offset: int
    is_self_attention: Callable[[nn.Module], bool]
    layer_shared: bool = True
    #: the two-pass attention settings (group, window, start) of Self-Extend and ReRoPE; None without them
    two_pass: TwoPassSettings | None = None
    #: what one forward computes once and every layer reuses (gradient-free: positions, bucket ids, merged masks,
    #: rotation matrices, block masks). A key is a name of what is kept, prefixed by its keeper ("t5-", "alibi-",
    #: "rope-", "flex-", "self-extend-", "ring-"), alone or as the first item of a tuple whose other items are what
    #: the value depends on. A key names a tensor (a mask, position rows) by ``schemes.base.pinned_id``, which keeps
    #: the tensor alive in the memo (its id is unique only while it lives). Dropped with the forward; empty under
    #: torch.compile (core/forward_memo.py).
    memo: ForwardMemo | CompiledMemo = field(default_factory=new_memo)

    #: explicit per-row positions [B, q] (position ids passed without cache or padding, e.g. PoSE training)
    row_positions: torch.Tensor | None = None
    #: per-row positions [B, kv] of a padded batch, from its 2D attention mask (set for Self-Extend, whose grouping
    #: floor(pos / G) depends on absolute positions, and for layer mixes with a query temperature: a left-padded
    #: row must not count its padding)
    padded_positions: torch.Tensor | None = None
    #: per-row offsets [B] of positions from token indices (minus a left-padded row's padding), set where absolute
    #: positions matter: a bias that reads the query's position (FIRE's normaliser, :meth:`bias_positions`), and
    #: Self-Extend and the query temperature where ``padded_positions`` does not cover the keys (a static cache,
    #: whose 4-D mask ``generate`` builds itself)
    row_shift: torch.Tensor | None = None
    #: the KV cache the forward was given (None: no cache, or one the model makes itself); rotary schemes store
    #: keys rotated in its layers (see :mod:`hf_posswap.core.rotary_cache`)
    cache: Any = None
    #: a layer mix: ``positions`` is then the mix's module, and :meth:`for_layer` gives each layer its own context
    layers: LayerPlan | None = None
    #: set by the attention function that reads the context (:class:`ForwardCheck` raises when no call did)
    reached_attention: bool = False
    #: this rank's shard under context parallelism (attention runs as a ring; ``query_offset`` is its global start)
    ring: Any = None

    def for_layer(self, module: nn.Module) -> PositionContext:
        """The context of the layer ``module`` belongs to (a mix), with that layer's part module, kind and settings
        and a memo shared by the layers of the same part; the context itself when the model has one scheme."""
        if self.layers is None:
            return self
        index = getattr(module, "layer_idx", None)
        memo_key = ("layer-context", index)
        found = self.memo.get(memo_key)
        if found is None:
            plan = self.layers
            if not isinstance(index, int) or not 0 <= index < len(plan.kinds):  # not a layer of the mix: no scheme
                return dataclasses.replace(self, positions=None, kind="none", layers=None, memo=new_memo())
            part = plan.parts[index]
            found = dataclasses.replace(
                self,
                positions=self.positions(index) if self.positions is not None else None,  # called: peft's copy
                kind=plan.kinds[index],
                layer_shared=plan.shared[index],
                two_pass=plan.two_pass[index],
                memo=self.memo.setdefault(("part-memo", part), new_memo()),
                layers=None,
            )
            self.memo[memo_key] = found
        return found

    def query_positions(self, q_len: int, device: torch.device) -> torch.Tensor:
        """Absolute positions of the queries, [q] or [B, q]: explicit position ids, else the padding-aware ones of a
        padded batch, else cache offset + index."""
        if self.row_positions is not None and self.row_positions.shape[-1] == q_len:
            return self.row_positions
        if self.padded_positions is not None and self.padded_positions.shape[-1] >= q_len:
            return self.padded_positions[:, -q_len:]
        index = torch.arange(q_len, device=device) + self.query_offset
        if self.row_shift is not None:
            return (index[None] + self.row_shift.to(device)[:, None]).clamp(min=0)  # [B, q]
        return index

    def query_key_positions(self, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """query positions [q] and key positions [kv] (or both [B, q] when explicit row positions are set); made
        once per forward (every layer asks for the same ones; callers must not change them in place)."""
        if self.row_positions is not None and self.row_positions.shape[-1] == q_len == kv_len:
            return self.row_positions, self.row_positions
        return self.token_indices(q_len, kv_len, device)

    def index_lag(self, q_len: int, kv_len: int) -> int:
        """The first query's token index minus the first key's: key j is in query i's past when j - i <= it."""
        return self.query_offset - self.key_start(q_len, kv_len)

    def token_indices(self, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' indices in the sequence, query [q] and key [kv] (cache offset + index): the order causality
        follows, whatever positions a scheme reads (position ids restarting in packed sequences, say)."""
        memo_key = ("positions", q_len, kv_len, device)
        found = self.memo.get(memo_key)
        if found is None:
            query_pos = torch.arange(self.query_offset, self.query_offset + q_len, device=device)
            start = self.key_start(q_len, kv_len)
            found = query_pos, torch.arange(start, start + kv_len, device=device)
            self.memo[memo_key] = found
        return found

    def bias_positions(self, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions a bias scheme reads: :meth:`query_key_positions`, shifted per row by :attr:`row_shift` for
        a scheme that reads the query's absolute position (then [B, q], [B, kv]): index distances as before, and a
        left-padded row's queries at the positions of the row alone."""
        query_pos, key_pos = self.query_key_positions(q_len, kv_len, device)
        if self.row_shift is None or query_pos.dim() != 1 or not reads_query_positions(self.positions):
            return query_pos, key_pos
        memo_key = ("row-shifted-positions", q_len, kv_len, device)
        found = self.memo.get(memo_key)
        if found is None:
            shift = self.row_shift.to(device)[:, None]  # [B, 1]
            # padding slots (before a row's first real token) at 0: masked as keys, and ignored as queries
            found = ((query_pos[None] + shift).clamp(min=0), (key_pos[None] + shift).clamp(min=0))  # [B, q], [B, kv]
            self.memo[memo_key] = found
        return found

    def key_start(self, q_len: int, kv_len: int) -> int:
        """Position of the first of kv_len keys. Static caches hand attention the whole buffer (kv_len >= offset +
        q_len): buffer index = position. Dynamic caches (possibly sliding) hold the latest kv_len tokens, ending at
        the current one."""
        return max(self.query_offset + q_len - kv_len, 0)


def _parameter_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The parameter names of a model class's ``forward``, without ``self`` (looked up once per class). Under
    ``torch.compile`` they are read afresh: dynamo traces through a cache and warns that it did (once per process)."""
    return (_read_parameter_names if torch.compiler.is_compiling() else _cached_parameter_names)(forward)


def _read_parameter_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(forward).parameters)[1:]


_cached_parameter_names = functools.cache(_read_parameter_names)


class PositionInputs:
    """Prepares the base model's forward kwargs for a swapped scheme (called by :class:`PositionForward`)."""

    def __init__(
        self,
        adapter: FamilyAdapter,
        kind: ContextKind,
        adds_absolute: bool,
        feeds_attention: bool,
        layer_shared: bool = True,
        two_pass: TwoPassSettings | None = None,
        carriers: dict[str, str] | None = None,
        combine: str = "add",
        layers: LayerPlan | None = None,
    ) -> None:
        self.adapter = adapter
        #: a layer mix's per-layer plan (None: one scheme for every layer)
        self.layers = layers
        #: user's attention implementation -> the one that reads the context (in-attention schemes need one)
        self.carriers = dict(carriers or {})
        self.two_pass = two_pass
        self.kind = kind
        self.layer_shared = layer_shared
        self.adds_absolute = adds_absolute
        #: how absolute vectors join the token embeddings: "add", or "concat" (the module then returns the embeddings)
        self.combine = combine
        self.feeds_attention = feeds_attention
        self.ring: Any = None  # inside ``context_parallel``: a RingGroup, each forward one shard of the sequence

    def __call__(
        self, base: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple, dict, ForwardCheck]:
        """The forward's (args, kwargs) with positions prepared, and what to check of its result."""
        kwargs = dict(kwargs)
        if args:  # move positional arguments to keywords so they can be read and replaced
            names = _parameter_names(type(base).forward)
            kwargs.update(zip(names, args, strict=False))
        if self.feeds_attention:
            self._check_attention_implementation(base)
        check_position_ids(kwargs)
        check_attention_mask(kwargs)
        cache = find_cache(kwargs, f"{type(base).__name__}.forward")
        shard = self.ring.prepare(kwargs, cache) if self.ring is not None else None
        # tokens before this forward: the cache's length, or the shard's global start under context parallelism
        query_offset = shard.starts[shard.rank] if shard is not None else cache_length(cache)
        positions = getattr(base, POSITIONS_ATTR, None)
        if self.layers is None:
            refuse_foreign_rotation(cache, positions, self.kind, self.two_pass)
        else:
            _refuse_foreign_rotation_per_layer(cache, positions, self.layers)
        passed_ids = kwargs.get("position_ids") is not None  # (not the index a family's prepare_inputs fills in)
        self.adapter.prepare_inputs(base, kwargs, query_offset)
        if self.adds_absolute and positions is not None:
            self._add_absolute(base, positions, kwargs, query_offset)
        context = None
        if self.feeds_attention:
            context = self._context(base, positions, kwargs, query_offset, cache, shard, passed_ids)
            kwargs[CONTEXT_KWARG] = context
        return (), kwargs, ForwardCheck(cache is not None, new_tokens(kwargs), context)

    def _context(
        self, base: nn.Module, positions: nn.Module | None, kwargs: dict[str, Any], query_offset: int, cache: Any,
        shard: Any, passed_ids: bool
    ) -> PositionContext:
        """The position context every attention call of this forward reads (``passed_ids``: the caller passed
        ``position_ids``; else attention reads the token index)."""
        # under context parallelism the shard carries the whole sequence's position ids (RingShard.explicit)
        explicit = shard is None and passed_ids
        row_positions = explicit_positions(kwargs, query_offset, cache) if explicit else None
        if row_positions is not None:  # a family's own numbering (RoBERTa's from padding_idx + 1) counted from 0
            row_positions = counted_from_zero(row_positions, self.adapter.first_position_id(base), self.adapter.name)
        needs_padded = self.two_pass is not None or (self.layers is not None and self.layers.needs_padded_positions)
        reads_absolute = reads_query_positions(positions)
        return PositionContext(
            positions,
            self.kind,
            query_offset,
            self.adapter.is_self_attention,
            self.layer_shared,
            self.two_pass,
            row_positions=row_positions,
            padded_positions=padded_positions(kwargs.get("attention_mask")) if needs_padded else None,
            row_shift=row_shifts(kwargs, query_offset) if shard is None and (needs_padded or reads_absolute) else None,
            cache=cache,
            layers=self.layers,
            ring=shard,
        )

    def _check_attention_implementation(self, base: nn.Module) -> None:
        """An in-attention scheme would be silently dropped by an attention function that ignores the context."""
        current = attention_implementation(base.config)
        allowed = sorted(set(self.carriers.values()))
        if self.carriers and current not in allowed:
            suggestion = self.carriers.get(current, allowed[-1])
            raise IncompatibleAttentionError(
                f"The model's attention implementation was changed to '{current}' after hf_posswap swapped in a "
                f"scheme that works inside attention (kind '{self.kind}'); '{current}' would silently ignore it. Call "
                f"model.set_attn_implementation('{suggestion}') (allowed: {', '.join(allowed)}), or "
                "hf_posswap.unswap(model) to go back to the native positions."
            )

    def _add_absolute(self, base: nn.Module, positions: nn.Module, kwargs: dict[str, Any], query_offset: int) -> None:
        """inputs_embeds [B, L, hidden] += positions(position_ids) for families without an absolute table slot; with
        ``combine="concat"`` the module is called as ``positions(position_ids, embeds)`` and returns the new
        embeddings [B, L, hidden] (it concatenates and projects back)."""
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # the family's own numbering (RoBERTa: from padding_idx + 1)
            position_ids = self.adapter.absolute_position_ids(base, kwargs, query_offset)
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = base.get_input_embeddings()(kwargs["input_ids"])
            kwargs["input_ids"] = None
        if position_ids is None:
            position_ids = default_position_ids(embeds.shape[1], query_offset, embeds.device)
        if self.combine == "concat":
            kwargs["inputs_embeds"] = positions(position_ids, embeds)
            return
        kwargs["inputs_embeds"] = embeds + positions(position_ids).to(embeds.dtype)


def _refuse_foreign_rotation_per_layer(cache: Any, positions: nn.Module | None, plan: LayerPlan) -> None:
    """A mix's check of a cache: a layer whose part needs unrotated keys refuses keys stored rotated in its slot
    (a length-independent RoPE part checks the rotation itself, in :mod:`~hf_posswap.core.rotary_cache`)."""
    for index, layer in enumerate(self_attention_layers(cache)[: len(plan.kinds)]):
        marker = getattr(layer, MARKER, None)
        if marker is None or min(marker.count, int(getattr(layer, "get_seq_length", lambda: 0)())) <= 0:
            continue
        part = positions(index) if positions is not None else None
        if plan.kinds[index] == "rotary" and rotates_once(part, plan.two_pass[index]):
            continue
        raise InvalidConfigError(
            f"The KV cache holds keys that a model with RoPE inside attention stored rotated (layer {index}), and "
            f"this model's layer {index} ('{plan.kinds[index]}' part of a layer mix) needs them unrotated. Continue "
            f"the cache with the model that filled it, or start a new one ({CACHE_KWARG}=None)."
        )


class PositionForward:
    """Stands in for ``base.forward`` on one model instance: prepares the kwargs with ``inputs``, then runs the
    forward that was there before (the class's own ``forward``, or another library's wrapper of it).

    ``inspect.signature`` sees the wrapped forward's signature (through ``__wrapped__``), so clients that choose
    their keyword arguments from it (sentence-transformers, ``Trainer``) keep working.
    """

    def __init__(self, base: nn.Module, inputs: PositionInputs, previous: Callable[..., Any] | None) -> None:
        self.base = base
        self.inputs = inputs
        #: the instance-level forward another library had installed (None: the class's own forward)
        self.previous = previous
        #: False once the swap is undone while another wrapper still holds this one (it then passes through)
        self.active = True
        self.__doc__ = type(base).forward.__doc__

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.previous if self.previous is not None else type(self.base).forward.__get__(self.base)

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "hook" in state:  # a model pickled (torch.save) by a release that called ``inputs`` ``hook``
            state["inputs"] = state.pop("hook")
        self.__dict__.update(state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self._forward(args, kwargs)
        args, kwargs, check = self.inputs(self.base, args, kwargs)
        with onloaded(getattr(self.base, POSITIONS_ATTR, None)):  # weights accelerate offloaded, for the forward
            outputs = self._forward(args, kwargs)
        check.verify(outputs)
        return outputs

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.base).forward(self.base, *args, **kwargs)


#: the name pickles (``torch.save(model)``) of earlier releases give PositionInputs
PositionHook = PositionInputs
