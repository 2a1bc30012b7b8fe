"""``hf-posswap``: the command line. Subcommands: ``demo`` (the main job), ``schemes`` (the support matrix)."""

from __future__ import annotations

import argparse
import sys

from .errors import PosSwapError


def _schemes(argv: list[str]) -> int:
    from .matrix import support_matrix_markdown

    argparse.ArgumentParser(prog="hf-posswap schemes", description="Print the family x scheme matrix.").parse_args(argv)
    print(support_matrix_markdown())
    return 0


def _demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


def _finetune(argv: list[str]) -> int:
    from .finetune import main as finetune_main

    return finetune_main(argv)


COMMANDS = {"demo": _demo, "finetune": _finetune, "schemes": _schemes}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: hf-posswap {demo,finetune,schemes} [options]\n\n"
            "  demo     swap the built-in SmolLM2 checkpoint to several schemes and compare them\n"
            "  finetune fine-tune a model with swapped positions (accelerate; LoRA via peft)\n"
            "  schemes  print the family x scheme support matrix\n\n"
            "Run `hf-posswap COMMAND --help` for the options of one command."
        )
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-posswap: unknown command '{command}'; choose from {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except (PosSwapError, FileNotFoundError, RuntimeError) as error:
        print(f"hf-posswap {command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
