"""Checks of ``extend``, ``eval`` and ``inspect`` that need only ``--model``'s small files (config.json, the
tokenizer), run before the model loads: a value the config already rules out costs no loading time.

What a checkpoint carries is read from its config.json: the ``posswap`` record of a swapped checkpoint, else the
family's native scheme (RoPE, a learned table, or none).
"""

from __future__ import annotations

import re
from typing import Any

from ..core.extend import LIFT, TABLE_METHODS, default_method, has_rope
from ..errors import InvalidConfigError, PosSwapError, one_line
from ..persistence.loading import ModelSource, inspect_model_path
from ..schemes.base import SchemeConfig

# --- what the checkpoint carries ----------------------------------------------------------------------------------


def _own_config(source: ModelSource) -> dict[str, Any]:
    """The config.json of the full model (an adapter's base)."""
    return source.base.config if source.base is not None else source.config


def carried_scheme(source: ModelSource) -> SchemeConfig | None:
    """The scheme config the checkpoint carries, from config.json alone (``None``: no position scheme)."""
    from ..families.base import FAMILY_REGISTRY
    from ..persistence.restore import scheme_from_record
    from ..schemes.learned import LearnedConfig
    from ..schemes.rope import RopeConfig

    record = _own_config(source).get("posswap")
    if isinstance(record, dict) and isinstance(record.get("scheme"), str):
        return scheme_from_record(record)
    if source.model_type not in FAMILY_REGISTRY:
        return None
    family = FAMILY_REGISTRY.get(source.model_type)
    if family.rotary_module_path is not None:
        return RopeConfig()
    return LearnedConfig() if family.absolute_table_path is not None else None


def _describe(scheme: SchemeConfig | None) -> str:
    from ..schemes.learned import LearnedConfig

    if isinstance(scheme, LearnedConfig):
        return "a learned position table"
    return f"'{scheme.name}'" if scheme is not None else "no position scheme"


def config_length(source: ModelSource) -> int | None:
    """The model's current context length from config.json (an extension's length, ``n_positions`` for GPT-2)."""
    from ..transformers_internals import config_mapping

    config = _own_config(source)
    record = config.get("posswap") if isinstance(config.get("posswap"), dict) else {}
    extension = record.get("extension") if isinstance(record.get("extension"), dict) else {}
    if isinstance(extension.get("max_position_embeddings"), int):
        return extension["max_position_embeddings"]
    try:
        built = config_mapping()[source.model_type].from_dict(
            {key: value for key, value in config.items() if key != "model_type"})
    except Exception:  # noqa: BLE001 - inspect_model_path built it already; a config it cannot build says nothing
        return None
    length = getattr(built, "max_position_embeddings", None)
    return length if isinstance(length, int) and not isinstance(length, bool) else None


def _trained_length(source: ModelSource, current: int) -> int:
    """The length the model was trained at, before any extension (what a RoPE scaling's factor divides)."""
    config = _own_config(source)
    record = config.get("posswap") if isinstance(config.get("posswap"), dict) else {}
    extension = record.get("extension") if isinstance(record.get("extension"), dict) else {}
    rope = next((config[key] for key in ("rope_parameters", "rope_scaling") if isinstance(config.get(key), dict)), {})
    original = extension.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    return original if isinstance(original, int) and not isinstance(original, bool) else current


# --- extend --------------------------------------------------------------------------------------------------------


def check_extension(model: str, to: int, method: str | None, options: dict[str, Any], train: bool) -> None:
    """``extend``'s length, method and method options, from ``--model``'s config.json: ``--to`` longer than the
    current length, a method the carried scheme takes, and options that build (``factor`` = to / trained length,
    as ``extend_context`` derives it)."""
    source = inspect_model_path(model)
    if train and source.kind == "adapter":
        raise InvalidConfigError(f"--model {model!r} is a LoRA adapter directory; --train starts from full weights: "
                                 "pass its base model, or the merged model.")
    current = config_length(source)
    if current is not None:
        _check_longer(model, to, current, _trained_length(source, current), train)
    scheme = carried_scheme(source)
    method = method or default_method(scheme)
    _check_method_fits(model, method, scheme)
    _check_method_options(method, options, _trained_length(source, current) if current else None, to)


def _check_longer(model: str, to: int, current: int, trained: int, train: bool) -> None:
    """``--to`` at least the current length; equal to it only where that rescales from a shorter trained length (a
    RoPE-scaled checkpoint given another method at its own length)."""
    if to < current:
        raise InvalidConfigError(f"--to {to} is shorter than the model's current length {current}; extend only "
                                 f"lengthens. Pass --to >= {current}.")
    if to == current and trained == current:
        instead = " (to fine-tune at this length, use hf-posswap finetune)" if train else ""
        raise InvalidConfigError(f"--to {to}: --model {model!r} already has {current} positions; nothing to extend. "
                                 f"Pass a longer --to{instead}.")


def _check_method_fits(model: str, method: str, scheme: SchemeConfig | None) -> None:
    """The method applies to what the checkpoint carries (a RoPE scaling needs RoPE, and so on)."""
    from ..schemes.learned import LearnedConfig
    from ..schemes.rope_scaling import SCALING_REGISTRY

    carried = _describe(scheme)
    if method in SCALING_REGISTRY and not has_rope(scheme):
        fix = "interpolate or copy" if isinstance(scheme, LearnedConfig) else LIFT
        raise InvalidConfigError(
            f"--method {method} scales RoPE, and --model {model!r} carries {carried} (its config.json); use --method "
            f"{fix}, or swap to RoPE first (hf-posswap swap --scheme rope), then extend.")
    if method in TABLE_METHODS and not isinstance(scheme, LearnedConfig):
        fix = "a RoPE scaling such as yarn" if has_rope(scheme) else LIFT
        raise InvalidConfigError(f"--method {method} grows a learned position table, and --model {model!r} carries "
                                 f"{carried} (its config.json); use --method {fix}.")
    if method == LIFT and (has_rope(scheme) or isinstance(scheme, LearnedConfig) or scheme is None):
        fix = "a RoPE scaling such as yarn" if has_rope(scheme) else "interpolate or copy"
        raise InvalidConfigError(f"--method lift only records a longer length for schemes without a limit (alibi, "
                                 f"t5, none, sinusoidal), and --model {model!r} carries {carried}; use --method {fix}.")


def _check_method_options(method: str, options: dict[str, Any], original: int | None, to: int) -> None:
    """A RoPE scaling's options build; the other methods take none."""
    from ..schemes.rope_scaling import SCALING_REGISTRY

    if method not in SCALING_REGISTRY:
        if options:
            raise InvalidConfigError(f"--method {method} takes no --option, got {', '.join(sorted(options))}; "
                                     "drop them.")
        return
    values = {"factor": to / original, "original_max_position_embeddings": original} if original else {}
    try:
        SCALING_REGISTRY.get(method).from_options(**{**values, **options})
    except PosSwapError as error:  # "YarnScaling.beta_fast must be ..." -> "--option beta_fast must be ..."
        raise InvalidConfigError(f"--method {method}: "
                                 + re.sub(r"\b(?:[A-Z]\w*Scaling|SelfExtend|ReRoPE)\.(\w+)", r"--option \1",
                                        one_line(error))) from error
    except (TypeError, ValueError) as error:
        raise InvalidConfigError(f"--method {method} with options {options}: {one_line(error)}") from error


# --- eval ----------------------------------------------------------------------------------------------------------


def check_text_covers(tokenizer, text: str | None, corpus: str, lengths: list[int]) -> None:
    """Every perplexity length fits in the evaluation text as the tokenizer splits it (needs no model)."""
    from ..evaluation.corpora import corpus_text, text_token_ids

    if not lengths:
        return
    tokens = len(text_token_ids(tokenizer, text if text is not None else corpus_text(corpus)))
    too_long = [length for length in lengths if length > tokens]
    if too_long:
        where = "the --text files" if text is not None else f"--corpus {corpus}"
        raise InvalidConfigError(
            f"--lengths {too_long[0]}: a window needs {too_long[0]} tokens of text, and {where} hold {tokens}; give "
            f"a longer text (more or longer --text files, or --corpus stdlib) or lengths of at most {tokens}.")


def check_learned_table(source: ModelSource, lengths: list[int]) -> None:
    """A length past the learned position table the config describes (GPT-2's ``n_positions``)."""
    from ..schemes.learned import LearnedConfig

    scheme = carried_scheme(source)
    if not isinstance(scheme, LearnedConfig) or not lengths:
        return
    current = scheme.max_positions or config_length(source)  # a learned swap may have grown the table past config's
    if current is None or max(lengths) <= current:
        return
    raise InvalidConfigError(
        f"--lengths {max(lengths)} exceeds the model's learned position table ({current} positions, from its "
        f"config.json). Use lengths <= {current}, or extend the context first (hf-posswap extend --to "
        f"{max(lengths)}).")


def write_results(results: dict[str, Any], output: str) -> None:
    """Write ``results`` to ``--output``; if that fails, print them on stdout as JSON first, so nothing measured
    is lost, then refuse in one line."""
    from ..evaluation.measure import results_json
    from ..persistence.saving import OutputError, write_file_atomic

    text = results_json(results)
    try:
        write_file_atomic(output, text)
    except OSError as error:
        print(text, flush=True)
        raise OutputError(f"--output {output!r}: could not write the results ({error.strerror or error}); they are "
                          "printed above as JSON: save them from there.") from error


# --- inspect -------------------------------------------------------------------------------------------------------


def check_drawable(model: str, scheme_name: str | None) -> None:
    """``inspect`` draws one scheme that carries a position signal: refuse ``none`` and layer mixes (drawn one
    scheme at a time) before loading."""
    if scheme_name is None:
        scheme = carried_scheme(inspect_model_path(model))
        name = scheme.name if scheme is not None else None
        what = f"--model {model!r} carries"
    else:
        scheme, name, what = None, scheme_name, "--scheme"
    if name == "none":
        raise InvalidConfigError(f"{what} 'none' (NoPE): it carries no position signal, so there is nothing to "
                                 "draw; pass --scheme with a scheme that does (e.g. --scheme rope).")
    if name == "layer_mix":
        raise InvalidConfigError(f"{what} 'layer_mix': inspect draws one scheme at a time, and a mix gives each "
                                 f"layer its own; {_mix_advice(scheme)}")


def _mix_advice(scheme: SchemeConfig | None) -> str:
    """Which schemes to draw for a mix: the checkpoint's parts, or the default mix's (RoPE on every layer)."""
    if scheme is None:
        return "with its default options every layer has RoPE, so draw it with --scheme rope."
    parts = [scheme.default.name, *(part.name for part, _ in scheme.overrides)]  # type: ignore[attr-defined]
    names = list(dict.fromkeys(name for name in parts if name != "none")) or ["rope"]
    shown = ", ".join(f"--scheme {name}" for name in names)
    return f"draw its schemes one at a time ({shown}; each drawn as newly swapped in, without trained values)."


def check_inspect_length(length: int | None, most: int) -> None:
    """``inspect --length``: 2 to ``most`` positions (:data:`~hf_posswap.cli.parser.MAX_INSPECT_LENGTH`)."""
    if length is not None and length < 2:
        raise InvalidConfigError(f"--length {length}: draw at least 2 positions.")
    if length is not None and length > most:
        raise InvalidConfigError(
            f"--length {length}: the pictures draw at most {most} positions (a picture is a few "
            f"hundred pixels across, and the bias picture holds heads x length x length numbers); pass --length "
            f"{most} or less."
        )


# --- checkpoint outputs (swap, extend, export) ---------------------------------------------------------------------


def check_checkpoint_output(output: str, overwrite: bool, flag: str = "--output", run: bool = False) -> None:
    """A checkpoint directory to write: named, short enough for its staging name, and free (or --overwrite);
    ``run``: an ``extend --train`` output, which may hold its run (``recipe.check_run_output`` decides)."""
    from ..persistence.output_names import STAGING_EXTRA, check_name_fits, check_output_given
    from ..persistence.saving import check_output_dir

    check_output_given(output, flag=flag, example="swapped-model/")
    check_name_fits(output, STAGING_EXTRA, flag=flag)
    if not run:
        check_output_dir(output, overwrite, flag=flag)


def check_exportable(source: ModelSource, checkpoint: str) -> None:
    """``export`` needs a checkpoint that only loads with hf_posswap (a swap transformers cannot express)."""
    from ..core.state import MODEL_TYPE_PREFIX

    swapped = source.record.get("scheme") if source.record else "posswap" in source.config
    if not swapped:
        raise InvalidConfigError(
            f"checkpoint {checkpoint!r} carries no hf_posswap swap (its config.json has no posswap record): "
            "it already loads with plain transformers; copy it instead of exporting."
        )
    model_type = str(source.config.get("model_type", ""))
    if swapped and not model_type.startswith(MODEL_TYPE_PREFIX):  # a swap transformers expresses by itself
        record = source.config.get("posswap") if isinstance(source.config.get("posswap"), dict) else {}
        extension = record.get("extension") if isinstance(record.get("extension"), dict) else {}
        what = f"'{record.get('scheme', 'native')}'" + (f", extended with '{extension['method']}'"
                                                       if extension.get("method") else "")
        raise InvalidConfigError(
            f"checkpoint {checkpoint!r} already loads without hf_posswap: its positions ({what}) are "
            f"written in transformers' own config (model_type '{model_type}'), so plain "
            "AutoModel*.from_pretrained reads them; there is nothing to export: copy the folder instead."
        )
