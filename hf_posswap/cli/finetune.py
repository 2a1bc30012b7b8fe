"""``hf-posswap finetune`` / ``python -m hf_posswap.cli.finetune`` / ``accelerate launch -m hf_posswap.cli.finetune``.

The parser needs no torch (``--help`` answers at once); the training loop is imported once the command line is
valid."""

from __future__ import annotations

import sys

from ..errors import PosSwapError, one_line
from .console import out_of_memory, out_of_memory_message, program_notes_hidden
from .parser import finetune_parser, forget_given
from .wording import in_cli_words

__all__ = ["main"]


PROG = "hf-posswap finetune"


def main(argv: list[str] | None = None) -> int:
    """Parse, run, report. A user error (bad value, file or directory; a diverged run) is one line on stderr and
    exit status 1; a bad command line exits with 2 (argparse)."""
    args = forget_given(finetune_parser().parse_args(sys.argv[1:] if argv is None else argv))
    from ..training.config import config_from_args
    from ..training.loop import finetune

    try:
        with program_notes_hidden(argv is None):
            result = finetune(config_from_args(args))
    except PosSwapError as error:
        print(f"{PROG}: {in_cli_words('finetune', one_line(error))}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk or a read-only directory while writing the run
        print(f"{PROG}: {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        kept = "Checkpoints written so far are kept (continue with --resume)"
        print(f"{PROG}: {out_of_memory_message(error, kept)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; checkpoints written so far are kept (continue with --resume).", file=sys.stderr)
        return 130
    print(summary(result))
    return 0


def summary(result: dict) -> str:
    """The closing line: losses to 4 significant digits (``eval loss 5.522``), not 16."""
    eval_loss = result.get("eval_loss")
    held_out = f"eval loss {eval_loss:.4g}" if eval_loss is not None else "eval loss n/a (no held-out data)"
    return (f"finished {result['steps']} steps: train loss {result['train_loss']:.4g}, {held_out}, "
            f"written to {result['output']}")


if __name__ == "__main__":
    raise SystemExit(main())
