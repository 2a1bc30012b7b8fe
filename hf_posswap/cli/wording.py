"""Errors in the command line's own words.

The library's errors name the Python API (``overwrite=True``, ``hf_posswap.available_schemes()``,
``LearnedConfig.max_positions=8``); a user of ``hf-posswap`` typed options, not calls. :func:`in_cli_words` rewrites
those phrases into the options the command takes, so the fix an error suggests is one the user can type.
"""

from __future__ import annotations

import re

#: the scheme config classes, whose fields are ``--option`` keys (``hf_posswap.available_schemes()``'s classes;
#: tests/cli/test_cli_results_and_messages.py checks they agree). Only these are rewritten: a transformers model
#: config named in a message (``BertConfig(is_decoder=True)``) is a setting of the model, not an option of the command.
SCHEME_CONFIGS = ("AlibiConfig", "FireConfig", "KerpleConfig", "LearnedConfig", "NoPEConfig", "ProportionalRopeConfig",
                  "RopeConfig", "SandwichConfig", "SinusoidalConfig", "T5BiasConfig", "XposConfig")
_SCHEME_CONFIG = rf"\b(?:{'|'.join(SCHEME_CONFIGS)})"

#: (command or None for all, pattern, replacement), applied in order
_REWRITES: tuple[tuple[str | None, str, str], ...] = (
    (None, r"List them with hf_posswap\.available_schemes\(\)\.", "List them with `hf-posswap schemes`."),
    (None, r" \(overwrite=True\)", ""),
    (None, r"\bpass ignore_mismatched_sizes=True\b", "load it in Python with ignore_mismatched_sizes=True"),
    # `hf-posswap extend --to N` is extend_context(model, max_positions=N)
    ("extend", r"^max_positions=(\d+)", r"--to \1"),
    ("extend", r"\bmatch max_positions=(\d+)", r"match --to \1"),
    ("extend", r"\bpass max_positions=(\d+)", r"pass --to \1"),
    ("extend", r"\b([Pp])ass a value >= the current length\b", r"\1ass --to >= the current length"),
    ("extend", r"\bextend_context only lengthens\b", "extend only lengthens"),
    (None, r"\bhf_posswap\.swap\(model, '(\w+)', replace=True\)", r"`hf-posswap swap --scheme \1` on it"),
    # fine-tuning settings are `finetune` options: FinetuneConfig.seq_len -> --seq-len
    ("finetune", r"\bFinetuneConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-")),  # type: ignore[misc]
    ("finetune", r"\bextend_method=", "--extend-method "),
    ("finetune", r"\bextend_to\b", "--extend-to"),
    ("finetune", r"^merge_lora needs lora=True\.", "--merge-lora needs --lora."),
    ("finetune", r"^resume and overwrite_output_dir exclude", "--resume and --overwrite-output-dir exclude"),
    ("finetune", r"\bscheme_options (\{.*?\}) need a scheme to apply to",
     r"--scheme-option \1 needs a --scheme to apply to"),
    # a decoder is a setting of the model: its config.json, which every command reads
    (None, r"\b(?:e\.g\. )?[A-Z]\w*Config\(is_decoder=True\)", 'set "is_decoder": true in its config.json'),
    # scheme options are `--option key=value` on the command line
    (None, _SCHEME_CONFIG + r"\(max_positions=\.\.\.\)\)", "--option max_positions=N)"),
    (None, r"\bpass " + _SCHEME_CONFIG + r"\((\w+)=(\w+)\)", r"pass --option \1=\2"),
    (None, _SCHEME_CONFIG + r"\((\w+)=(\w+)\)", r"--option \1=\2"),
    (None, _SCHEME_CONFIG + r"\.(\w+)=", r"--option \1="),
    (None, r"\bor (keep_weights|trainable_slopes|shared_across_layers)=(True|False)\b",
     lambda m: f"or --option {m.group(1)}={m.group(2).lower()}"),  # type: ignore[misc]
    # evaluation settings are options of `eval`
    ("eval", r"\bpass tail_from \(--tail-from; ", "pass --tail-from ("),
    ("eval", r"\btail_from=", "--tail-from "),
    ("eval", r"\b0 < tail_from < length=(\d+)", r"0 < --tail-from < length \1"),
)


def in_cli_words(command: str, message: str) -> str:
    """``message`` (one line) with the Python API's names replaced by the options of ``hf-posswap command``."""
    for only, pattern, replacement in _REWRITES:
        if only is None or only == command:
            message = re.sub(pattern, replacement, message)
    return message
