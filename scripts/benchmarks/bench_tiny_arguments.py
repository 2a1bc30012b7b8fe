"""What ``bench_tiny.py``'s command line (Protocol A) may name, and the checks on it: the runs and RoPE scalings
it can train, and what refuses a command's runs, numbers or page before hours of training rather than after them.
Its options themselves are declared in ``bench_tiny.py`` (``build_parser``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_tiny_training import ANSWER_TOKENS, Settings, split_run

import hf_posswap as ps

#: every run's label; "X+concat" is scheme X with combine="concat"; "nope-interleaved" is the SmolLM3 preset (NoPE on
#: every 2nd layer of the 2-layer model, RoPE on the others). Runs whose scheme is not registered are left out.
#: ``--schemes`` also takes a run with scheme options, "X:key=value[,key=value]" (e.g. "sandwich:dim=32").
RUNS = ("learned", "learned+concat", "sinusoidal", "sinusoidal+concat", "none", "rope", "alibi", "t5", "kerple",
        "sandwich", "fire", "xpos", "proportional", "nope-interleaved")
#: --quick's default runs: the six of the first table plus the two concatenations (add vs concat); every run in RUNS
#: would take about 25 minutes on 2 cores (--schemes picks any)
QUICK_RUNS = ("learned", "learned+concat", "sinusoidal", "sinusoidal+concat", "none", "rope", "alibi", "t5")
SCALINGS = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "self_extend")


def available_runs() -> tuple[str, ...]:
    """The runs of RUNS whose schemes (and, for "nope-interleaved", the presets) this hf_posswap has."""
    schemes = set(ps.available_schemes())

    def available(label: str) -> bool:
        if label == "nope-interleaved":
            return hasattr(ps, "smollm3_nope")
        return label.split("+")[0] in schemes

    return tuple(label for label in RUNS if available(label))


def run_label(text: str) -> str:
    """argparse type of ``--schemes``: a run of :func:`available_runs`, optionally with options its scheme accepts
    (checked now, with the scheme's own validation, not after hours of other runs)."""
    from hf_posswap.errors import PosSwapError
    from hf_posswap.schemes.base import SCHEME_REGISTRY

    try:
        run, options = split_run(text)
    except PosSwapError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error} As in sandwich:dim=32.") from error
    runs = available_runs()
    if run not in runs:
        raise argparse.ArgumentTypeError(f"unknown run {run!r}; choose from {', '.join(runs)}")
    if options:
        if run in ("rope", "nope-interleaved"):
            raise argparse.ArgumentTypeError(f"{text!r}: run {run!r} takes no options (it is not a swapped scheme)")
        try:
            SCHEME_REGISTRY.get(run.split("+")[0]).from_options(**options)
        except (PosSwapError, TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from error
    return text


def settings_problem(settings: Settings, args: argparse.Namespace) -> str | None:
    """What is wrong with the command's numbers, said before hours of training (None: nothing)."""
    counts = {"steps": settings.steps, "finetune-steps": settings.finetune_steps, "length": settings.length,
              "trials": settings.trials, "batch": settings.batch, "layers": settings.layers, "jobs": args.jobs}
    for name, value in counts.items():
        if value < 1:
            return f"--{name} {value}: must be at least 1"
    if settings.length <= ANSWER_TOKENS:
        return (f"--length {settings.length}: must be more than {ANSWER_TOKENS} (a passkey prompt and its "
                f"{ANSWER_TOKENS}-token answer must fit in L)")
    if not 0 < settings.lr < float("inf"):
        return f"--lr {settings.lr}: must be a positive number"
    if not 0 <= settings.weight_decay < float("inf"):
        return f"--weight-decay {settings.weight_decay}: must be a number >= 0 (e.g. 0.01, the default, or 0.1)"
    for name, value in (("synthetic", settings.synthetic), ("passkey-share", settings.passkey_share)):
        if not 0 <= value <= 1:
            return f"--{name} {value}: must be a share in [0, 1]"
    if not 0 <= settings.decay_from < 1:
        return f"--decay-from {settings.decay_from}: must be in [0, 1) (the decay needs steps after it)"
    if not 0 <= settings.curriculum <= settings.decay_from:
        return (f"--curriculum {settings.curriculum}: must be a share in [0, --decay-from {settings.decay_from}] "
                "(the length reaches L before the learning rate decays)")
    if any(not 0 <= seed < 2**32 for seed in settings.seeds):
        return f"--seeds {' '.join(map(str, settings.seeds))}: each seed must be in [0, 2**32)"
    if args.probe_every < 0:
        return f"--probe-every {args.probe_every}: must be 0 (no probes) or a positive number of steps"
    if len(set(settings.seeds)) != len(settings.seeds):
        return f"--seeds {' '.join(map(str, settings.seeds))}: a seed is given twice"
    if args.schemes and len(set(args.schemes)) != len(args.schemes):
        return f"--schemes {' '.join(args.schemes)}: a run is given twice (its rows would count twice)"
    if settings.until_retrieval and (settings.until_retrieval <= settings.steps or args.probe_every <= 0):
        return (f"--until-retrieval {settings.until_retrieval}: needs a larger maximum than --steps ({settings.steps}) "
                f"and --probe-every N (the probes decide when retrieval appeared); e.g. --until-retrieval "
                f"{2 * settings.steps} --probe-every 1000")
    if settings.confirm_retrieval < 1 or (settings.confirm_retrieval > 1 and not settings.until_retrieval):
        return (f"--confirm-retrieval {settings.confirm_retrieval}: must be at least 1, and more than 1 only with "
                "--until-retrieval (it counts the probes in a row that must retrieve before the decay starts)")
    return None


def check_writable_readme(readme: Path | None, parser: argparse.ArgumentParser) -> None:
    if readme is None:
        return
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"--readme {readme}: cannot read it ({error})")
    if "<!-- bench-tiny:start -->" not in text or "<!-- bench-tiny:end -->" not in text:
        parser.error(f"--readme {readme}: has no <!-- bench-tiny:start --> / <!-- bench-tiny:end --> markers to "
                     "write between; add them where the section goes")
