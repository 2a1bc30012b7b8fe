"""What scripts/benchmarks/bench_speed.py measures with: the models, the timed steps, the alternation and peak memory.

Every timer reads the clock after ``torch.cuda.synchronize`` when its input lives on a CUDA device (kernels run
asynchronously; without the synchronisation the clock would stop when the last kernel is queued, not done), and
plainly on the CPU. Peak memory has two forms: on the CPU a fresh interpreter per model reads ``/proc`` (VmHWM);
on CUDA the caching allocator's own peak (``torch.cuda.max_memory_allocated``) in this process.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

import hf_posswap as ps
from hf_posswap.transformers_internals import CACHE_KWARG

#: the case "scheme" that is not a swap: Self-Extend (Jin et al. 2024, arXiv:2401.01325) through extend_context
SELF_EXTEND = "self-extend"
#: Self-Extend cases declare an original length of (prompt length) / SELF_EXTEND_FACTOR, so most pairs are grouped
SELF_EXTEND_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model size. The default is big enough that attention dominates at long context."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8  # head dim = hidden / heads = 64
    kv_heads: int = 2  # LLaMA only; GPT-2 and BERT have one key-value head per query head
    llama_intermediate: int = 1408  # ~8/3 x hidden, LLaMA's proportion; GPT-2 and BERT use 4 x hidden
    vocab: int = 4096


QUICK_SHAPE = Shape(layers=2, hidden=64, heads=4, kv_heads=2, llama_intermediate=192, vocab=256)
#: a LLaMA-like decoder of realistic width for one GPU: head dim 128 and 4:1 grouped-query attention as in
#: Llama-3 / TinyLlama, MLP 2.75 x hidden; ~0.3 B parameters, so a bf16 training step at 32,768 tokens takes well
#: under a second with sdpa and its activations (~20 GB) fit an 80 GB card beside two copies of the model
CUDA_SHAPE = Shape(layers=4, hidden=2048, heads=16, kv_heads=4, llama_intermediate=5632, vocab=32000)


def build(family: str, shape: Shape, max_positions: int, device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A seeded model of ``family`` on ``device`` in ``dtype`` (sdpa attention, no dropout, so that only the
    position scheme differs). Built on the device itself: the same seed gives the same weights for every model
    built there."""
    torch.manual_seed(0)
    with torch.device(device):
        model = _from_config(family, shape, max_positions)
    return model.to(dtype=dtype)


def _from_config(family: str, shape: Shape, max_positions: int) -> PreTrainedModel:
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.llama_intermediate,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            max_position_embeddings=max_positions, attn_implementation="sdpa"))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=shape.vocab, n_embd=shape.hidden, n_layer=shape.layers, n_head=shape.heads,
            n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            attn_implementation="sdpa"))
    return BertForMaskedLM(BertConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=4 * shape.hidden, max_position_embeddings=max_positions,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))


def build_patched(family: str, scheme: str, shape: Shape, length: int, new_tokens: int,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The patched side of a case: ``family`` swapped to ``scheme``, or for :data:`SELF_EXTEND` a model declared
    at length / 4 and extended to the whole run with Self-Extend (its default window and group size)."""
    if scheme != SELF_EXTEND:
        model = build(family, shape, length + new_tokens, device, dtype)
        ps.swap(model, scheme)
        return model
    model = build(family, shape, max(length // SELF_EXTEND_FACTOR, 4), device, dtype)
    ps.extend_context(model, length + new_tokens, "self_extend")
    return model


def prompt(shape: Shape, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The same seeded token ids for every model of a length: [1, length]."""
    ids = torch.randint(0, shape.vocab, (1, length), generator=torch.Generator().manual_seed(length))
    return ids.to(device)


def clock(device: torch.device) -> float:
    """perf_counter, after every queued kernel of ``device`` has finished (CUDA); plain on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_forward(model: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """Seconds of one inference forward over the whole input."""
    model.eval()
    start = clock(input_ids.device)
    with torch.no_grad():
        model(input_ids=input_ids)
    return clock(input_ids.device) - start


def time_train(model: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """Seconds of one training step, forward + backward of the LM loss (BERT: MLM loss over every token)."""
    model.train()
    model.zero_grad(set_to_none=True)
    start = clock(input_ids.device)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return clock(input_ids.device) - start


def time_decode(model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds of ``new_tokens`` greedy steps with the KV cache after the prompt, fed as ``generate`` feeds them
    (attention mask and position ids); the prefill runs before the clock starts, fresh each time."""
    model.eval()
    length, device = input_ids.shape[1], input_ids.device
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
        start = clock(device)
        for step in range(new_tokens):
            token = out.logits[:, -1:].argmax(-1)
            # the cache travels under the running release's name, in the output and as the argument
            cache = {CACHE_KWARG: getattr(out, CACHE_KWARG)}
            out = model(input_ids=token, **cache, use_cache=True,
                        attention_mask=torch.ones(1, length + step + 1, dtype=torch.long, device=device),
                        position_ids=torch.tensor([[length + step]], device=device))
    return clock(device) - start


def alternate(native: Callable[[], float], patched: Callable[[], float], repeats: int, warmups: int = 1) -> dict:
    """Run each ``warmups`` times (the first call timed apart: on CUDA it holds compilation and autotuning), then
    ``repeats`` pairs, flipping the order every pair (A B, B A, ...) so neither side always runs first. Returns the
    medians (s), the median, min and max of the per-pair ratios, and the first calls' seconds."""
    first = native(), patched()
    for _ in range(warmups - 1):
        native(), patched()
    pairs = []
    for index in range(repeats):
        if index % 2 == 0:
            t_native = native()
            t_patched = patched()
        else:
            t_patched = patched()
            t_native = native()
        pairs.append((t_native, t_patched))
    ratios = [p / n for n, p in pairs]
    return {"native": statistics.median(n for n, _ in pairs), "patched": statistics.median(p for _, p in pairs),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "first_native": first[0], "first_patched": first[1]}


def cuda_peak(model: PreTrainedModel, step: Callable[[PreTrainedModel], object], device: torch.device) -> dict:
    """Peak MB the caching allocator held during one ``step(model)``: in all (weights and the other model
    included) and over what was allocated just before. One unmeasured step first, so that compilation and
    workspace set-up are not counted; gradients are dropped before each step (a training step's own count)."""
    step(model)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    idle = torch.cuda.memory_allocated(device)
    step(model)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return {"peak_mb": peak / 2**20, "over_idle_mb": (peak - idle) / 2**20}


def release_cuda_memory(device: torch.device) -> bool:
    """Give cached blocks back after a case or a failed (e.g. out-of-memory) step, so the next starts clean (a
    failed step's traceback may hold tensors in reference cycles, hence the collection). False when the device
    itself failed: after a kernel fault (illegal memory access) every later CUDA call in this process fails too."""
    if device.type != "cuda":
        return True
    gc.collect()
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - torch.AcceleratorError, RuntimeError: the context is gone, whatever the type
        return False
    return True


def memory_probe(family: str, scheme: str | None, length: int, shape: dict, threads: int,
                 dtype: str = "float32") -> None:
    """Run in a fresh subprocess: build (and patch) the model, then one forward of ``length`` tokens; print the
    peak resident MB of the whole process and the part of it above the process just before the forward."""
    torch.set_num_threads(threads)
    precision = getattr(torch, dtype)
    if scheme:
        model = build_patched(family, scheme, Shape(**shape), length, 0, dtype=precision).eval()
    else:
        model = build(family, Shape(**shape), length, dtype=precision).eval()
    input_ids = prompt(Shape(**shape), length)
    idle = _status_kb("VmRSS")
    reset = _reset_peak()  # VmHWM := VmRSS, so building the model does not count
    with torch.no_grad():
        model(input_ids=input_ids)
    peak = _status_kb("VmHWM")
    print(json.dumps({"peak_mb": peak / 1024, "over_idle_mb": (peak - idle) / 1024 if reset else None}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def measure_memory(
    family: str, scheme: str | None, length: int, shape: Shape, threads: int, mmap_threshold: int | None = None,
    dtype: str = "float32",
) -> dict:
    """memory_probe in a fresh interpreter (VmHWM, not ru_maxrss, which would carry the parent's over fork).

    ``mmap_threshold`` (bytes) fixes glibc's ``MALLOC_MMAP_THRESHOLD_`` in that interpreter: every allocation of at
    least that size is its own mapping, given back when freed, so VmHWM follows the peak of live tensors instead of
    how fragmented the heap got (glibc raises its threshold to the size of each freed mapping, up to 32 MiB, after
    which tensors up to that size are carved from the heap and their freed pages stay resident)."""
    call = f"m.memory_probe({family!r}, {scheme!r}, {length}, {dataclasses.asdict(shape)!r}, {threads}, {dtype!r})"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"import bench_speed_measure as m; {call}")
    env = None if mmap_threshold is None else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {result.returncode}: {tail}"}
    return json.loads(result.stdout.strip().splitlines()[-1])
