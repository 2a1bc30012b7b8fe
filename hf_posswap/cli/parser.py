"""The command line's argument parsers: one builder per command, every option with its help text.

Built without torch or transformers (``hf-posswap CMD --help`` answers at once), so the names the parsers offer
come from the constants below rather than from the registries; a test checks they agree. A malformed command line
is one line on stderr, never a usage block.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..errors import PosSwapError

#: positions `inspect` draws unless --length says otherwise
INSPECT_LENGTH = 256
#: the most positions `inspect` draws: a picture is a few hundred pixels across, and the bias picture holds
#: heads x length x length numbers (2 GiB for 32 heads at 4,096)
MAX_INSPECT_LENGTH = 4096
#: the built-in scheme names (``hf_posswap.available_schemes()``; tests/cli/test_cli_fast.py checks they agree)
SCHEMES = ("learned", "sinusoidal", "none", "rope", "alibi", "t5", "kerple", "sandwich", "fire", "xpos", "proportional",
           "layer_mix")
#: the built-in context-extension methods (``hf_posswap.available_extension_methods()``)
EXTENSION_METHODS = ("linear", "ntk", "dynamic", "yarn", "longrope", "llama3", "self_extend", "rerope", "interpolate",
                     "copy", "lift")
#: perplexity modes and built-in corpora of ``hf_posswap.evaluation``
MODES = ("windows", "sliding", "tail")
CORPORA = ("reference", "pydoc", "stdlib")


class UsageError(PosSwapError, ValueError):
    """A malformed command line (unknown option, a value of the wrong type)."""


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends with the option's default when there is one worth saying (not None, False or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unsaid = default is None or default is False or default is argparse.SUPPRESS or default == []
        if "default" in text or unsaid or not action.option_strings:
            return text
        return f"{text} (default: {' '.join(map(str, default)) if isinstance(default, list) else default})"


#: the namespace attribute where :class:`StoreOnce` notes the options given so far (removed after parsing)
GIVEN = "_options_given"


class StoreOnce(argparse._StoreAction):
    """A single-valued option (``--scheme``, ``--lengths``, ...): given twice, the command line is refused, as a
    repeated ``--option`` key is, rather than the last value silently replacing the first."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = vars(namespace).setdefault(GIVEN, {})
        if option_string is not None and self.dest in given:
            shown = " ".join(map(str, values)) if isinstance(values, list) else values
            raise argparse.ArgumentError(self, f"given twice ({given[self.dest]}, then {option_string} {shown}); "
                                               "give it once, with the value you mean")
        if option_string is not None:
            shown = " ".join(map(str, values)) if isinstance(values, list) else values
            given[self.dest] = f"{option_string} {shown}".strip()
        super().__call__(parser, namespace, values, option_string)


def single_valued(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with each of its single-valued options refusing to be given twice (:class:`StoreOnce`); for a
    parser built elsewhere (``finetune``'s). Pass what it parses through :func:`forget_given`."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = StoreOnce
    return parser


def forget_given(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` without :class:`StoreOnce`'s bookkeeping."""
    vars(args).pop(GIVEN, None)
    return args


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (printed as one line) instead of printing a usage block, and refuses
    a single-valued option given twice (:class:`StoreOnce`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        return forget_given(parsed), extras

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def _overwrite(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty output: replace the checkpoint files there and remove other "
                             "weight files (model*.safetensors, pytorch_model*.bin and their indexes, which would "
                             "load in place of the new ones); every other file stays")


def schemes_parser() -> OneLineParser:
    return OneLineParser(prog="hf-posswap schemes", description="Print the family x scheme support matrix and "
                         "every scheme's options (--option KEY=VALUE of swap and extend).")


def doctor_parser() -> OneLineParser:
    return OneLineParser(prog="hf-posswap doctor", description="Check hf_posswap in this environment: tiny models "
                         "of every family swapped to each scheme kind must give cached = uncached generation, "
                         "padded rows = rows alone, eager = sdpa, save/reload and model.forward = model(). Prints "
                         "a table with the installed versions; exits 1 if any check fails. Takes a few seconds.")


def export_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="hf-posswap export",
        description="Write a trust_remote_code copy of an hf_posswap checkpoint that loads without hf_posswap "
                    "(the source's tokenizer is copied with it).",
    )
    parser.add_argument("checkpoint", help="a checkpoint saved from a swapped model (or a LoRA adapter of one)")
    parser.add_argument("output", help="directory to write")
    _overwrite(parser)
    return parser


def eval_parser() -> OneLineParser:
    parser = OneLineParser(prog="hf-posswap eval", description="Perplexity against length and passkey retrieval of a "
                           "causal LM. Give --lengths, --passkey-lengths or both.")
    parser.add_argument("--model", required=True, help="checkpoint or LoRA adapter directory (causal LMs only)")
    parser.add_argument("--lengths", nargs="*", type=int, default=[], metavar="N",
                        help="context lengths in tokens for perplexity, e.g. --lengths 512 1024 2048")
    parser.add_argument("--mode", nargs="+", default=["windows"], choices=MODES,
                        help="how each length is scored: windows (whole non-overlapping windows), sliding "
                             "(overlapping windows, see --stride), tail (only positions from --tail-from on)")
    parser.add_argument("--stride", type=int,
                        help="sliding mode only: window stride in tokens (default: length / 2)")
    parser.add_argument("--tail-from", type=int,
                        help="tail mode only: score positions from here on (default: the model's trained length)")
    parser.add_argument("--max-windows", type=int, default=4, help="windows per length (0: all of them)")
    parser.add_argument("--text", nargs="+", metavar="FILE", help="text files to evaluate on instead of --corpus")
    parser.add_argument("--corpus", default="reference", choices=CORPORA,
                        help="built-in text: reference (typing.py + argparse.py + tarfile.py), pydoc (Python's "
                             "documentation topics) or stdlib (the standard library's sources)")
    parser.add_argument("--passkey-lengths", nargs="*", type=int, default=[], metavar="N",
                        help="prompt lengths in tokens for passkey retrieval (a key hidden in filler text; the prompt "
                             "has this many tokens, special tokens included)")
    parser.add_argument("--depths", nargs="*", type=float, default=[0.0, 0.5, 1.0], metavar="D",
                        help="where the passkey sits in the prompt: 0 = start, 1 = end")
    parser.add_argument("--trials", type=int, default=5, help="passkey prompts per length and depth")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights' dtype for the evaluation (auto: as saved, transformers' default; float32 "
                             "gives numbers comparable across checkpoints saved in different dtypes)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars or progress lines on stderr (results still go to stdout)")
    return parser


def swap_parser() -> OneLineParser:
    parser = OneLineParser(prog="hf-posswap swap", description="Swap a checkpoint's position scheme and save it "
                           "(with the source's tokenizer).")
    parser.add_argument("--model", required=True, help="checkpoint directory (a LoRA adapter is merged first)")
    parser.add_argument("--scheme", required=True,
                        help=f"scheme name: {', '.join(SCHEMES)} (see `hf-posswap schemes`)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                        help="a scheme option, e.g. --option num_buckets=64 (repeatable)")
    parser.add_argument("--output", required=True, help="directory to write")
    _overwrite(parser)
    return parser


def extend_parser() -> OneLineParser:
    from .recipe import add_training_options  # no torch: --help answers at once

    parser = OneLineParser(prog="hf-posswap extend", description="Extend a checkpoint's context length and save it "
                           "(with the source's tokenizer); with --train, fine-tune it briefly first (PoSE, LoRA).")
    parser.add_argument("--model", required=True, help="checkpoint directory (a LoRA adapter is merged first)")
    parser.add_argument("--to", type=int, required=True, help="new context length in tokens")
    parser.add_argument("--method", help=f"one of {', '.join(EXTENSION_METHODS)} (default: yarn for RoPE, "
                                         "interpolate for learned tables, lift otherwise)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                        help="a method option, e.g. --option beta_fast=16 (repeatable)")
    parser.add_argument("--output", required=True, help="directory to write (the --model directory with --overwrite)")
    _overwrite(parser)
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars or progress lines on stderr")
    add_training_options(parser)
    return parser


def inspect_parser() -> OneLineParser:
    parser = OneLineParser(prog="hf-posswap inspect", description="Pictures of a model's position scheme.")
    parser.add_argument("--model", required=True, help="checkpoint directory (or LoRA adapter directory)")
    parser.add_argument("--scheme", help=f"swap to this scheme first: {', '.join(SCHEMES)} (default: what the "
                                         "checkpoint carries)")
    parser.add_argument("--length", type=int, default=None,
                        help=f"positions to draw, 2 to {MAX_INSPECT_LENGTH} (default: {INSPECT_LENGTH}, or a learned "
                             "table's length when shorter)")
    parser.add_argument("--output", default="inspect", help="directory for the PNG files")
    return parser


def plot_parser() -> OneLineParser:
    parser = OneLineParser(prog="hf-posswap plot", description="Plot `hf-posswap eval` results.")
    parser.add_argument("runs", nargs="+", help="results.json files, optionally labelled: label=results.json")
    parser.add_argument("--mode", default="windows", choices=MODES, help="which perplexity rows to plot")
    parser.add_argument("--trained-length", type=int, help="draw a line at the trained length")
    parser.add_argument("--output", default="perplexity.png",
                        help="picture of perplexity against length (.png, .pdf, .svg); skipped, with a note, for "
                             "results holding passkey rows only")
    parser.add_argument("--passkey-output", help="also draw the passkey heatmap of the first run here")
    return parser


def finetune_parser() -> argparse.ArgumentParser:
    from ..training.config import build_parser

    return single_valued(build_parser("hf-posswap finetune", formatter_class=DefaultsFormatter))


#: the parser of every command but ``demo`` (whose parser lives with it in ``cli/demo.py``)
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "doctor": doctor_parser,
    "eval": eval_parser,
    "export": export_parser,
    "extend": extend_parser,
    "finetune": finetune_parser,
    "inspect": inspect_parser,
    "plot": plot_parser,
    "schemes": schemes_parser,
    "swap": swap_parser,
}


def wants_help(argv: list[str]) -> bool:
    """Whether ``argv`` asks for a command's help (nothing is loaded then)."""
    return any(arg in ("-h", "--help") for arg in argv)
