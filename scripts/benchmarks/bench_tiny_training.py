"""Protocol A's pieces (docs/benchmarks.md): the settings, the training text and synthetic examples, the tiny
LLaMA-shaped models with their position scheme set by ``hf_posswap.swap``, their training loop and schedule, and
their evaluation. ``bench_tiny.py`` runs them as the benchmark (its command line, tasks and workers); the recipe
scripts reuse them.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_posswap as ps
from hf_posswap.evaluation import BYTE_VOCAB_SIZE, corpus_text, passkey_accuracy, perplexity
from hf_posswap.evaluation.passkey import passkey_prompt, shortest_passkey_length

# The evaluation's passkey format with a filler that shares no long substring with "The pass key is": with the
# default filler ("The sky is blue") a byte-level model must match 6+ bytes to tell the key's "y is " apart.
FILLER = "Grass grows. Birds fly. Rain falls. Wind blows. Rivers run. Stars shine. Here we go. "

ANSWER_TOKENS = 8  # " 12345." plus the one token greedy decoding reads past it
PROBE_WINDOWS = 8  # held-out windows of L tokens read by each training probe
PROBE_READS = ("passkey", "held-out ppl", "training ppl")  # what each probe returns, in order

@dataclasses.dataclass
class Settings:
    length: int = 128  # training length L
    hidden: int = 128
    layers: int = 2
    heads: int = 4  # head_dim = hidden / heads = 32
    kv_heads: int = 2
    steps: int = 2500
    batch: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.01  # AdamW's, training from scratch (GPT-3 and LLaMA trained with 0.1)
    # share of sequences that are passkey / copy examples; at docs/benchmarks.md's ~20 % the RoPE model did not learn to
    # copy in 1,600 steps nor retrieve in 2,000; at 60 % ALiBi retrieved by ~2,200 (probes on 2 cores)
    synthetic: float = 0.6
    factors: tuple[int, ...] = (1, 2, 4, 8)
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    trials: int = 4  # passkey keys per (length, depth)
    max_windows: int = 4  # perplexity windows per length
    extend_factor: int = 4  # RoPE scalings target extend_factor x L
    finetune_steps: int = 60
    finetune_batch: int = 4
    finetune_lr: float = 1e-3
    seeds: tuple[int, ...] = (0,)
    passkey_share: float = 0.5  # of the synthetic sequences, the share that are passkey examples (the rest: copy)
    decay_from: float = 0.8  # the learning rate decays linearly to 10 % over the steps after this share of them
    until_retrieval: int = 0  # > steps: the stable phase lasts until a probe retrieves, ending by this step (Schedule)
    confirm_retrieval: int = 1  # with until_retrieval: consecutive probes that must retrieve before the decay starts
    curriculum: float = 0.0  # > 0: the training length ramps from L/4 to L over this share of the steps (LengthRamp)


def split_run(label: str) -> tuple[str, dict]:
    """``"fire:shared_across_layers=false,mlp_width=64"`` -> ``("fire", {...})``; a plain run has no options."""
    from hf_posswap.training.config import parse_options

    run, sep, options = label.partition(":")
    return run, (parse_options(options.split(",")) if sep else {})


QUICK = Settings()
# 10,000 steps: at L = 256 in-distribution retrieval appears abruptly, between 4,000 and 6,000 steps (probes every
# 1,000 steps, seed 0, H100); 6,000 left no margin for other seeds
FULL = Settings(length=256, steps=10_000, depths=(0.0, 0.25, 0.5, 0.75, 1.0), trials=10, max_windows=16,
                finetune_steps=200, seeds=(0, 1, 2))


# --- data ------------------------------------------------------------------------------------------------------


def corpus_split(tokenizer, text: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The documentation topics as bytes (``text``; None: this Python's pydoc topics): the first 90 % for training,
    the last 10 % held out for perplexity."""
    ids = torch.tensor(tokenizer(corpus_text("pydoc") if text is None else text)["input_ids"])
    cut = int(0.9 * ids.numel())
    return ids[:cut], ids[cut:]


def corpus_fingerprint(text: str | None = None) -> str:
    """sha256 (16 hex digits) of the topics read (None: this Python's): they change with the Python version, and so
    do perplexities."""
    import hashlib

    return hashlib.sha256((corpus_text("pydoc") if text is None else text).encode("utf-8")).hexdigest()[:16]


MIN_CORPUS_CHARACTERS = 100_000  # the topics are ~465k; 10 % held out must still give 16 windows of 8x L = 2,048


def read_corpus_file(path: Path) -> str:
    """The topics written by ``--write-corpus`` under another Python (so that seeds run under different Pythons read
    the same text). Raises ValueError, saying why and the fix, if missing, not UTF-8 or too short."""
    try:
        text = path.read_bytes().decode("utf-8")  # bytes: no newline translation, the text exactly as written
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--corpus-file {path}: cannot read it as UTF-8 text ({error}); write one with "
                         "`python scripts/benchmarks/bench_tiny.py --write-corpus FILE`") from None
    if len(text) < MIN_CORPUS_CHARACTERS:
        raise ValueError(f"--corpus-file {path}: {len(text):,} characters, too short for the topics (~465k); write "
                         "it with `python scripts/benchmarks/bench_tiny.py --write-corpus FILE`")
    return text


def write_corpus_file(path: Path) -> str:
    """Write this Python's topics to ``path`` (atomically) for ``--corpus-file`` elsewhere; returns the fingerprint."""
    import os

    text = corpus_text("pydoc")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_bytes(text.encode("utf-8"))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return corpus_fingerprint(text)


def passkey_example(tokenizer, length: int, rng: random.Random) -> list[int]:
    """The evaluation's passkey prompt at a random depth, followed by its answer, cut to ``length`` tokens (below
    the shortest prompt, the needle and question alone, the cut keeps their end)."""
    key = f"{rng.randrange(10_000, 100_000)}"
    answer = tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]
    prompt_length = max(length - len(answer), shortest_passkey_length(tokenizer, [key]))
    prompt = passkey_prompt(tokenizer, prompt_length, rng.random(), key, FILLER).tolist()
    return (prompt + answer)[-length:]


def passkey_prompt_length(tokenizer, length: int) -> int:
    """The passkey prompt measured at ``length``: shortened by the answer, so that prompt and answer fit in
    ``length`` tokens; a length too short for any prompt (the tests' tiny settings; a run's lengths are hundreds of
    tokens) measures the shortest prompt, the needle and question alone."""
    return max(length - ANSWER_TOKENS, shortest_passkey_length(tokenizer))


def copy_example(tokenizer, length: int, rng: random.Random) -> list[int]:  # same signature as passkey_example
    """A random lowercase string repeated with separators: learnable only by looking back (induction)."""
    span = rng.randrange(8, max(9, length // 3))
    chunk = "".join(chr(rng.randrange(97, 123)) for _ in range(span)) + "|"
    return tokenizer(chunk * (length // len(chunk) + 1), add_special_tokens=False)["input_ids"][:length]


class LengthRamp:
    """A length curriculum: the training length of each batch drawn, from L/4 up to L linearly over the first
    ``share`` of ``steps`` batches (multiples of 8 tokens), then L. Shorter sequences first make the look-back that
    retrieval needs easier to find (e.g. for NoPE, whose only position signal is the causal mask)."""

    def __init__(self, length: int, steps: int, share: float) -> None:
        self.length, self.start = length, max(ANSWER_TOKENS + 1, length // 4)
        self.ramp = int(share * steps)
        self.drawn = 0

    def __call__(self) -> int:
        step, self.drawn = self.drawn, self.drawn + 1
        if step >= self.ramp:
            return self.length
        grown = self.start + (self.length - self.start) * step // self.ramp
        return max(self.start, grown - grown % 8)


def batches(
    tokenizer, train_ids: torch.Tensor, length: int | Callable[[], int], batch: int, synthetic: float, seed: int,
    passkey_share: float = 0.5,
) -> Iterator:
    """Endless [batch, length] batches: corpus crops, and with probability ``synthetic`` a passkey example
    (``passkey_share`` of them) or a copy example. ``length`` may be a callable (a :class:`LengthRamp`), asked once a
    batch."""
    rng = random.Random(seed)
    fixed = length
    while True:
        length = fixed() if callable(fixed) else fixed
        rows = []
        for _ in range(batch):
            if rng.random() < synthetic:
                make = passkey_example if rng.random() < passkey_share else copy_example
                rows.append(make(tokenizer, length, rng))
            else:
                start = rng.randrange(0, train_ids.numel() - length)
                rows.append(train_ids[start : start + length].tolist())
        yield torch.tensor(rows)


# --- models and training ----------------------------------------------------------------------------------------


def build_model(settings: Settings, label: str, seed: int, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=settings.hidden,
        intermediate_size=3 * settings.hidden,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=settings.length,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    run, options = split_run(label)
    if run == "nope-interleaved":
        ps.swap(model, ps.smollm3_nope(model, no_rope_layer_interval=2))
    elif run.endswith("+concat"):
        ps.swap(model, run.split("+")[0], combine="concat", **options)
    elif run != "rope":  # RoPE is LLaMA's own scheme
        ps.swap(model, run, **options)
    return model.to(device)


def tile_learned_table(model: torch.nn.Module, length: int) -> None:
    """Grow a learned table to ``length`` rows by tiling it (rows < L, so 1x, are unchanged). ``extend_context`` does
    this for an added table; for a concatenated one it cannot yet (it would lose the projection), so the table inside
    the concatenation is tiled here the same way (``grow_table``, method ``copy``)."""
    from hf_posswap.core.extend import grow_table

    module = getattr(model.model, "posswap_positions", None)
    table = getattr(module, "positions", None)
    if table is None:
        ps.extend_context(model, length, "copy")
        return
    table.weight = torch.nn.Parameter(grow_table(table.weight.detach(), length, "copy"))


class TrainingDiverged(RuntimeError):
    """A training loss that is not finite: the run is stopped rather than measured."""


class TrainingFailed(RuntimeError):
    """Runs of a --jobs pool failed; the others' results were kept."""


RETRIEVAL_TARGET = 0.9  # in-distribution passkey accuracy read as "retrieves" (Protocol A's bar)


class Schedule:
    """Warm-up over 5 % of ``steps``, a stable phase, then a linear decay to 10 % over the last ``1 - decay_from``
    of them (warmup-stable-decay: retrieval circuits form late, and an early decay delayed them in probes).

    ``max_steps`` > ``steps`` makes the stable phase last until training probes retrieve (>= 90 %): the decay
    starts at the ``confirm``-th probe in a row that does, from ``decay_from * steps`` on, or at the latest where it
    still ends by ``max_steps``; the decay keeps its length. Protocol A asks for "enough steps that in-distribution
    passkey accuracy is above 90 %", and the step at which retrieval appears varies by scheme and seed
    (3,000-10,000+). A probe is few trials (12), so one lucky probe can end the stable phase of a run that has not
    learned to retrieve; ``confirm`` = 2 asks for a second one."""

    def __init__(self, steps: int, decay_from: float, max_steps: int = 0, confirm: int = 1) -> None:
        self.warmup = max(1, steps // 20)
        self.earliest = int(decay_from * steps)
        self.decay_length = max(1, steps - self.earliest)
        self.adaptive = max_steps > steps
        self.latest = max_steps - self.decay_length if self.adaptive else self.earliest
        self.decay_start: int | None = None if self.adaptive else self.earliest
        self.confirm = confirm
        self.retrieving = 0  # probes in a row, up to the last one, that retrieved

    @property
    def total_steps(self) -> int:
        return (self.latest if self.decay_start is None else self.decay_start) + self.decay_length

    def factor(self, step: int) -> float:
        """The learning rate's multiplier at optimizer step ``step`` (0-based)."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay_start is None or step < self.decay_start:
            return 1.0
        return 1.0 - 0.9 * (step - self.decay_start) / self.decay_length

    def observe(self, done: int, accuracy: float | None) -> None:
        """After ``done`` steps (and a probe's accuracy, if one ran): start the decay if it is time."""
        if accuracy is not None:
            self.retrieving = self.retrieving + 1 if accuracy >= RETRIEVAL_TARGET else 0
        if self.decay_start is None and done >= self.earliest and (
                done >= self.latest or (accuracy is not None and self.retrieving >= self.confirm)):
            self.decay_start = done


def train(
    model: torch.nn.Module, data: Iterator, steps: int, lr: float, desc: str,
    probe: Callable[[], list[float]] | None = None,
    probe_every: int = 0, decay_from: float = 0.8, max_steps: int = 0, weight_decay: float = 0.01,
    confirm: int = 1,
) -> tuple[list[float], list[list[float]], Schedule]:
    """AdamW on :class:`Schedule` (``max_steps``, ``confirm``: train until retrieval, see there). Returns the loss
    per step, every ``probe_every`` steps [step, *probe()] (in-distribution passkey, held-out and training
    perplexity), and the schedule (its ``total_steps`` and ``decay_start`` say what ran)."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    plan = Schedule(steps, decay_from, max_steps, confirm)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.factor)
    device = next(model.parameters()).device
    model.train()
    losses, curve = [], []
    bar = tqdm(total=plan.total_steps, desc=desc, leave=False, disable=None)
    step = 0
    while step < plan.total_steps:
        input_ids = next(data).to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        value = float(loss.detach())  # one read of the loss a step (a device sync on a GPU)
        if not math.isfinite(value):  # a diverged run never becomes a result
            raise TrainingDiverged(f"{desc}: the loss is {value} at step {step + 1}; lower --lr (or "
                                   "--finetune-lr) or check the run's settings")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        step += 1
        accuracy = None
        if probe is not None and probe_every and step % probe_every == 0:
            model.eval()
            curve.append([step, *probe()])
            accuracy = curve[-1][1]
            bar.write(f"  {desc} step {step}: " + ", ".join(  # the probes in a log, where no bar is drawn
                f"{name} {value:.0%}" if name == "passkey" else f"{name} {value:.2f}"
                for name, value in zip(PROBE_READS, curve[-1][1:], strict=False)))
            model.train()
        plan.observe(step, accuracy)
        bar.total = plan.total_steps
        bar.update(1)
    bar.close()
    model.eval()
    return losses, curve, plan


# --- evaluation -------------------------------------------------------------------------------------------------


def measure(model: torch.nn.Module, tokenizer, heldout: torch.Tensor, settings: Settings) -> dict:
    """Perplexity (windows; tail past L and sliding with stride L beyond 1x) and passkey accuracy per length."""
    row: dict = {"windows": {}, "tail": {}, "sliding": {}, "passkey": {}, "passkey_by_depth": {}}
    for factor in settings.factors:
        length = factor * settings.length
        windows = perplexity(model, heldout, length, "windows", max_windows=settings.max_windows)
        row["windows"][factor] = windows.perplexity
        if factor > 1:
            row["tail"][factor] = perplexity(
                model, heldout, length, "tail", tail_from=settings.length, max_windows=settings.max_windows
            ).perplexity
            row["sliding"][factor] = perplexity(
                model, heldout, length, "sliding", stride=settings.length, max_windows=settings.max_windows
            ).perplexity
        prompt_length = passkey_prompt_length(tokenizer, length)
        by_depth = {
            depth: passkey_accuracy(model, tokenizer, prompt_length, depth, settings.trials, filler=FILLER).accuracy
            for depth in settings.depths
        }
        row["passkey_by_depth"][factor] = by_depth
        row["passkey"][factor] = statistics.mean(by_depth.values())
    return row


def bias_profile(model: torch.nn.Module, length: int) -> dict | None:
    """What a bias scheme ended up with: the logit bias of the last query of a length-``length`` window against the
    key ``distance`` tokens back, minus the bias at distance 0, per layer and head (None: no bias scheme). A head
    whose bias falls by many nats at distance ~L cannot retrieve a passkey from the start of the window.
    ``{"distances": [...], "layers": [layer][head][distance]}``."""
    from hf_posswap.schemes.base import BiasPositions

    module = next((m for m in model.modules() if isinstance(m, BiasPositions)), None)
    if module is None:
        return None
    distances = sorted({0, *(2**k for k in range(length.bit_length()) if 2**k < length), length - 1})
    keys = torch.arange(length, device=next(model.parameters()).device)
    layers = []
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            bias = module(keys[-1:], keys, layer, True)[0, :, 0].float()  # [1, H, 1, L] -> [H, L]
            relative = bias - bias[:, -1:]  # against the diagonal (distance 0)
            layers.append([[round(float(row[length - 1 - d]), 3) for d in distances] for row in relative])
    return {"distances": distances, "layers": layers}


def extend_rope(model: torch.nn.Module, method: str, settings: Settings) -> torch.nn.Module:
    """The RoPE scaling ``method`` for extend_factor x L."""
    target = settings.extend_factor * settings.length
    if method == "longrope":  # no searched factors here: short = 1, long ramps from 1 (fastest) to the factor
        half = settings.hidden // settings.heads // 2
        ramp = [1 + (settings.extend_factor - 1) * i / (half - 1) for i in range(half)]
        return ps.extend_context(model, target, "longrope", short_factor=[1.0] * half, long_factor=ramp)
    if method == "self_extend":  # neighbours within L/4 exact, farther ones grouped so that 4L is reached
        window = settings.length // 4
        group = -(-(target - window) // (settings.length - window))
        return ps.extend_context(model, target, "self_extend", group_size=group, neighbor_window=window)
    return ps.extend_context(model, target, method)


def make_probe(model: torch.nn.Module, tokenizer, train_ids: torch.Tensor, heldout: torch.Tensor,
               length: int) -> Callable[[], list[float]]:
    """A training probe (PROBE_READS): in-distribution passkey at ``length`` (fewer keys than the evaluation; other
    keys: seed 1), held-out perplexity on the evaluation's first windows of ``length``, and the same on the training
    text's first windows (seen many times): retrieval, and overfitting (the gap between the two perplexities)."""

    def probe() -> list[float]:
        depths = (0.0, 0.5, 1.0)
        accuracy = statistics.mean(passkey_accuracy(model, tokenizer, passkey_prompt_length(tokenizer, length), depth,
                                                    4, seed=1, filler=FILLER).accuracy for depth in depths)
        heldout_ppl = perplexity(model, heldout, length, max_windows=PROBE_WINDOWS).perplexity
        train_ppl = perplexity(model, train_ids, length, max_windows=PROBE_WINDOWS).perplexity
        return [accuracy, heldout_ppl, train_ppl]

    return probe
