"""``hf_posswap.self_check()`` and ``hf-posswap doctor``: the library's guarantees, run end to end where it runs.

hf_posswap lives inside transformers' internals, so whether it computes the right numbers depends on the releases of
torch, transformers, peft and accelerate the user has. This runs, in seconds and without any download, what the
test suite checks on every tested release: tiny models of every family (built from configs, seeded), swapped to one
scheme of each kind, must give

- **cached = uncached**: greedy ``generate`` with the KV cache scores every step as a full recompute does;
- **padding**: a padded row of a batch gives the logits of the row run alone (left padding for decoders, right
  padding for encoders);
- **eager = sdpa**: the two attention carriers agree;
- **save/reload**: ``save_pretrained`` then the Auto class's ``from_pretrained`` gives the same logits;
- **forward = call**: ``model.forward(...)`` (what sentence-transformers calls) equals ``model(...)``.

A check that raises (a :class:`~hf_posswap.transformers_internals.TransformersDriftError`, say) fails with its
message. Kinds a family cannot carry (Self-Extend on an encoder) are "n/a".
"""

from __future__ import annotations

import copy
import importlib.metadata
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError, one_line

#: logits of the same computation by two paths agree to this (fp32 tiny models: differences are ~1e-6)
TOLERANCE = 1e-4
VOCAB = 64
MAX_POSITIONS = 32
#: prompt length: past MAX_POSITIONS, so the two-pass kind (Self-Extend from MAX_POSITIONS on) groups positions
PROMPT = 40
NEW_TOKENS = 4
#: one model type per family adapter (the LLaMA adapter also serves Mistral, Qwen2/3, ...; one of them is enough)
FAMILIES = ("gpt2", "bert", "roberta", "llama", "gemma3_text", "phi3", "gpt_neox")
ENCODERS = ("bert", "roberta")
CHECKS = ("cached = uncached", "padding", "eager = sdpa", "save/reload", "forward = call")
#: packages whose versions the report names
PACKAGES = ("torch", "transformers", "peft", "accelerate", "safetensors")


def _tiny_config(family: str) -> Any:
    """A 2-layer config of ``family`` (grouped-query attention where the family has it)."""
    from transformers import AutoConfig

    shared = {"vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, "pad_token_id": 0}
    decoder = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 64, "bos_token_id": 1, "eos_token_id": 2}
    settings: dict[str, dict[str, Any]] = {
        "gpt2": {"n_positions": MAX_POSITIONS, "n_embd": 32, "n_layer": 2, "n_head": 4, "bos_token_id": 1,
                 "eos_token_id": 2},
        "bert": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
        "roberta": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                    "max_position_embeddings": MAX_POSITIONS + 2, "pad_token_id": 1},
        "llama": decoder,
        "gemma3_text": {**decoder, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 16,
                        "layer_types": ["sliding_attention", "full_attention"]},
        "phi3": {**decoder, "original_max_position_embeddings": MAX_POSITIONS, "eos_token_id": None},
        "gpt_neox": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                     "bos_token_id": 1, "eos_token_id": 2},
    }
    options = {**shared, **settings[family]}
    return AutoConfig.for_model(family, **options)


def _tiny_model(family: str, attention: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(0)
    auto = AutoModelForMaskedLM if family in ENCODERS else AutoModelForCausalLM
    return auto.from_config(_tiny_config(family), attn_implementation=attention).eval()


def _kinds() -> dict[str, Callable[[nn.Module], Any]]:
    """Scheme kind -> how a tiny model is swapped to it."""
    from ..core.extend import extend_context
    from ..core.swap import swap
    from ..schemes import LayerMix

    def two_pass(model: nn.Module) -> None:
        swap(model, "rope", replace=True)
        extend_context(model, 2 * MAX_POSITIONS, "self_extend", group_size=4, neighbor_window=8)

    return {
        "absolute": lambda model: swap(model, "sinusoidal"),
        "rotary": lambda model: swap(model, "rope", replace=True),
        "bias (alibi)": lambda model: swap(model, "alibi"),
        "bias (t5)": lambda model: swap(model, "t5"),
        "two-pass": two_pass,
        "mix": lambda model: swap(model, LayerMix(default="t5", overrides=[("rope", [0])])),
    }


@dataclass(frozen=True)
class CheckResult:
    """One check of one (family, kind): ``ok`` None when the kind does not apply to the family."""

    family: str
    kind: str
    check: str
    ok: bool | None
    detail: str = ""


@dataclass
class SelfCheckReport:
    """The versions checked and every check's result; ``ok`` when no check failed."""

    versions: dict[str, str]
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    #: what from_pretrained does with hub kernels here (transformers 5.25 made them the default)
    hub_kernels: str = ""

    @property
    def ok(self) -> bool:
        return all(result.ok is not False for result in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [result for result in self.results if result.ok is False]

    def table(self) -> str:
        """The report as text: versions, one line per (family, check) with a column per scheme kind, then one line
        per failure saying what differed."""
        kinds = list(dict.fromkeys(result.kind for result in self.results))
        cells = {(r.family, r.check, r.kind): "ok" if r.ok else ("n/a" if r.ok is None else "FAIL")
                 for r in self.results}
        lines = ["hf_posswap self-check: " + ", ".join(f"{name} {version}" for name, version in self.versions.items())]
        if self.hub_kernels:
            lines.append(f"hub kernels: {self.hub_kernels}")
        width = max(len(check) for check in CHECKS) + max(len(family) for family, *_ in cells) + 3
        lines.append(" " * width + "  ".join(f"{kind:>12}" for kind in kinds))
        for family in dict.fromkeys(r.family for r in self.results):
            for check in CHECKS:
                row = "  ".join(f"{cells.get((family, check, kind), ''):>12}" for kind in kinds)
                lines.append(f"{family + ' / ' + check:<{width}}{row}")
        for failure in self.failures:
            lines.append(f"FAIL {failure.family} / {failure.kind} / {failure.check}: {failure.detail}")
        verdict = "all checks passed" if self.ok else f"{len(self.failures)} check(s) FAILED"
        lines.append(f"{verdict} ({len(self.results)} checks, {self.seconds:.1f} s)")
        return "\n".join(lines)


def versions() -> dict[str, str]:
    """Installed versions of the packages the report names (``-`` when one is missing)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "-"
    return found


def self_check(families: str | tuple[str, ...] = FAMILIES) -> SelfCheckReport:
    """Run every check on tiny models of ``families`` (one name or several; default: one of each family adapter);
    see the module docs. transformers' progress bars and log lines are hidden while it runs."""
    from transformers.utils import logging as transformers_logging

    from ..persistence.autoload import register
    from ..progress import library_bars
    from ..transformers_internals import hub_kernels_state

    families = (families,) if isinstance(families, str) else tuple(families)
    unknown = [family for family in families if family not in FAMILIES]
    if unknown or not families:
        raise InvalidConfigError(f"self_check has no tiny model for {unknown or 'no family'}; choose one or more of "
                                 f"{', '.join(FAMILIES)}.")
    register()  # save/reload goes through the Auto classes, as a user's own code does
    start = time.perf_counter()
    report = SelfCheckReport(versions(), hub_kernels=hub_kernels_state())
    verbosity, threads = transformers_logging.get_verbosity(), torch.get_num_threads()
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny matrices: threads cost more than they give, and fight with other processes
    try:
        with library_bars(False):
            for family in families:
                for kind, apply in _kinds().items():
                    report.results.extend(_check_pair(family, kind, apply))
    finally:
        transformers_logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - start
    return report


def _check_pair(family: str, kind: str, apply: Callable[[nn.Module], Any]) -> list[CheckResult]:
    """Every check of one (family, kind); a swap the family refuses makes them all n/a."""
    if kind == "two-pass" and family in ENCODERS:  # Self-Extend groups positions of a causal model's past
        return [CheckResult(family, kind, check, None, "causal models only") for check in CHECKS]
    model = _tiny_model(family)
    eager = _tiny_model(family, attention="eager")
    try:
        for copy_ in (model, eager):
            apply(copy_)
            _give_signal(copy_)
    except Exception as error:  # noqa: BLE001 - a swap that fails fails every check, with its message
        return [CheckResult(family, kind, check, False, f"swap: {one_line(error)}") for check in CHECKS]
    checks: dict[str, Callable[[], float | None]] = {
        "cached = uncached": lambda: _cached_equals_uncached(model, family),
        "padding": lambda: _padding_equals_alone(model, family),
        "eager = sdpa": lambda: _max_difference(_logits(eager, _prompt()), _logits(model, _prompt())),
        "save/reload": lambda: _save_reload(model, family),
        "forward = call": lambda: _max_difference(_logits(model, _prompt(), direct=True), _logits(model, _prompt())),
    }
    results = []
    for check, run in checks.items():
        try:
            difference = run()
        except Exception as error:  # noqa: BLE001 - any error is a failed check, reported with its message
            results.append(CheckResult(family, kind, check, False, f"{type(error).__name__}: {one_line(error)}"))
            continue
        if difference is None:
            results.append(CheckResult(family, kind, check, None, "does not apply"))
        else:
            ok = difference <= TOLERANCE
            results.append(CheckResult(family, kind, check, ok, f"max |difference| {difference:.3g}"))
    return results


def _give_signal(model: nn.Module) -> None:
    """Random values for the scheme's trained parameters (T5's tables start at zero: a bias of zeros would pass
    every check whatever the code did with it); the same values in every copy of one (family, kind)."""
    positions = getattr(model.base_model, "posswap_positions", None)
    if positions is None:
        return
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in positions.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype))


def _prompt(batch: int = 1, length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def _logits(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, direct: bool = False) -> torch.Tensor:
    """Logits [B, L, vocab] through ``model(...)``, or ``model.forward(...)`` when ``direct``."""
    with torch.no_grad():
        call = model.forward if direct else model
        return call(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max())


def _cached_equals_uncached(model: nn.Module, family: str) -> float | None:
    """Greedy decoding's per-step scores with and without the KV cache."""
    if family in ENCODERS:
        return None
    scores = []
    for use_cache in (True, False):
        with torch.no_grad():
            out = model.generate(input_ids=_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=use_cache,
                                 pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        scores.append(torch.stack(out.scores))
    return _max_difference(*scores)


def _padding_equals_alone(model: nn.Module, family: str) -> float:
    """A padded row of a two-row batch against the row alone (its real tokens' logits)."""
    rows = _prompt(batch=2)
    pad = 3
    short = rows[1, pad:]
    alone = _logits(model, short[None])[0]
    batch, mask = rows.clone(), torch.ones_like(rows)
    pad_id = model.config.pad_token_id
    if family in ENCODERS:  # right padding: [tokens..., pad pad pad]
        batch[1] = torch.cat((short, torch.full((pad,), pad_id)))
        mask[1, -pad:] = 0
        padded = _logits(model, batch, mask)[1, :-pad]
    else:  # left padding: [pad pad pad, tokens...]
        batch[1, :pad] = pad_id
        mask[1, :pad] = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding-aware, as generate() passes them
        padded = _logits(model, batch, mask, positions)[1, pad:]
    return _max_difference(padded, alone)


def _save_reload(model: nn.Module, family: str) -> float:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForMaskedLM if family in ENCODERS else AutoModelForCausalLM
    with tempfile.TemporaryDirectory(prefix="hf_posswap_self_check_") as directory:
        model.save_pretrained(directory)
        reloaded = auto.from_pretrained(directory).eval()
    return _max_difference(_logits(reloaded, _prompt()), _logits(copy.deepcopy(model), _prompt()))
