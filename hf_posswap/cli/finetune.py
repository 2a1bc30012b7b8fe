"""``python -m hf_posswap.finetune`` / ``hf-posswap finetune`` / ``accelerate launch -m hf_posswap.finetune``."""

from __future__ import annotations

import sys

from ..errors import PosSwapError
from ..training.config import FinetuneConfig, build_parser, config_from_args
from ..training.loop import finetune

__all__ = ["FinetuneConfig", "finetune", "main"]


PROG = "hf-posswap finetune"


def main(argv: list[str] | None = None) -> int:
    """Parse, run, report. A user error (bad value, file or directory; a diverged run) is one line on stderr and
    exit status 1; a bad command line exits with 2 (argparse)."""
    args = build_parser(PROG).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = finetune(config_from_args(args))
    except PosSwapError as error:
        print(f"{PROG}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk or a read-only directory while writing the run
        print(f"{PROG}: {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; checkpoints written so far are kept (continue with --resume).", file=sys.stderr)
        return 130
    print(f"finished {result['steps']} steps: train loss {result['train_loss']:.4f}, "
          f"eval loss {result['eval_loss']}, written to {result['output']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
