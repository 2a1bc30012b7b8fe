"""Sharded training (FSDP2 ``fully_shard`` over 2 or 4 gloo processes on CPU) equals training in one process, saves a
full model that reloads with the same logits, and resumes from a sharded (DCP) checkpoint with the same losses, in as
many processes as saved it or in more.

Three spawns serve every test. The first (2 processes) trains every (family, scheme) case sharded and in one process
and makes the uninterrupted run whose checkpoint the others resume from: the second in 2 fresh processes, the third
in 4, after training a few cases over 4 processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import NATIVE_PAIRS, VOCAB, make_model, swapped
from process_launch import free_port, run_again_if_killed, spawn

import hf_posswap as ps

WORLD = 2
STEPS = 3
BATCH, SEQ = 4, 24  # each process trains on BATCH // WORLD rows
LR = 1e-2
CASES = [(family, scheme) for family in ("llama", "gpt2") for scheme in ("rope", "alibi", "t5", "kerple", "fire")]
CASES.append(("llama", "mix"))  # a layer mix: KERPLE in layer 0, a T5 table in layer 1
BIAS_SCHEMES = {"alibi", "t5", "kerple", "fire", "mix"}
BF16_CASES = [("llama", "t5"), ("gpt2", "fire")]  # also trained with parameters gathered in bf16
RESUMED = ("llama", "t5")  # the run resumed from a sharded checkpoint
#: also trained over WIDE processes (one row each), which then resume the 2-process checkpoint (DCP reshards it)
WIDE = 4
WIDE_CASES = [("llama", "t5"), ("gpt2", "kerple"), ("llama", "fire"), ("llama", "mix")]
RESUME_STEPS = 4


# --- what every process runs -------------------------------------------------------------------------------------


def _batch(step: int) -> torch.Tensor:
    """The full batch of ``step``, [BATCH, SEQ]: the same in every process and after a resume."""
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def _model(family: str, scheme: str) -> torch.nn.Module:
    from hf_posswap.training.model import enable_checkpointing

    if scheme == "mix":
        model = make_model(family).train()
        ps.swap(model, ps.LayerMix(default="kerple", overrides={"t5": [1]}))
    else:
        model = swapped(family, scheme).train()
    enable_checkpointing(model)
    return model


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _position_names(model: torch.nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if "posswap_positions" in name and param.requires_grad]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: a weight's error stays proportional to its gradient's. (Adam divides a gradient by its own
    size, so a 1e-10 gradient that differs in its last bits moves a weight by a visibly different amount.)"""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _train_alone(family: str, scheme: str) -> tuple[torch.nn.Module, list[float], dict[str, torch.Tensor]]:
    """STEPS optimizer steps on the full batches in this process: (model, losses, first step's position gradients)."""
    model = _model(family, scheme)
    optimizer = _optimizer(model)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = _loss(model, _batch(step))
        loss.backward()
        if step == 0:
            grads = {name: model.get_parameter(name).grad.clone() for name in _position_names(model)}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses, grads


def _train_sharded(family: str, scheme: str, rank: int,
                   mixed_precision: str | None = None) -> tuple[torch.nn.Module, list[float], dict, list[str]]:
    """The same steps with the model sharded and each process holding half of each batch; also the attention paths
    the forwards took."""
    from hf_posswap.core.paths import record_paths
    from hf_posswap.training.sharding import shard_model

    model = shard_model(_model(family, scheme), mixed_precision=mixed_precision)
    optimizer = _optimizer(model)
    world = dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses, grads, paths = [], {}, []
    for step in range(STEPS):
        with record_paths() as taken:  # the attention paths the position context led to
            loss = _loss(model, _batch(step)[rows])
        paths += taken
        loss.backward()
        if step == 0:
            grads = {name: _whole(model.get_parameter(name).grad) for name in _position_names(model)}
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return model, losses, grads, sorted(set(paths))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered from every process (``full_tensor``); a replicated one (a scalar) as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


def _compare_case(family: str, scheme: str, rank: int, directory: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_posswap.persistence.autoload import register
    from hf_posswap.training.sharding import full_state_dict, save_full_model

    start = time.perf_counter()
    sharded, sharded_losses, sharded_grads, paths = _train_sharded(family, scheme, rank)
    full = full_state_dict(sharded)
    sharded.eval()
    with torch.no_grad():
        sharded_logits = sharded(input_ids=_batch(99), use_cache=False).logits
    save_full_model(sharded, directory)
    if rank != 0:
        return {}
    alone, alone_losses, alone_grads = _train_alone(family, scheme)
    register()
    reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=_batch(99), use_cache=False).logits
    return {
        "alone_losses": alone_losses,
        "sharded_losses": sharded_losses,
        "paths": paths,
        "position_parameters": sorted(sharded_grads),
        "position_grad_diff": _max_diff(sharded_grads, alone_grads),
        "weights_diff": _max_diff(full, dict(alone.state_dict())),
        "position_weights_moved": _max_diff({k: v for k, v in alone.state_dict().items() if k in sharded_grads},
                                            {k: v for k, v in _model(family, scheme).state_dict().items()
                                             if k in sharded_grads}),
        "position_weights_diff": _max_diff({k: v for k, v in full.items() if k in sharded_grads},
                                           {k: v for k, v in alone.state_dict().items() if k in sharded_grads}),
        "reloaded_scheme": ps.describe(reloaded).scheme,
        "reloaded_logits_diff": float((reloaded_logits - sharded_logits).abs().max()),
        "seconds": time.perf_counter() - start,
    }


def _bf16_case(family: str, scheme: str, rank: int) -> dict:
    """The sharded steps with parameters gathered in bf16 (gradients reduced in float32)."""
    dtypes = set()

    def attention_dtype(module: torch.nn.Module, args: tuple, output) -> None:
        if type(module).__name__.endswith("Attention"):
            dtypes.add(str((output[0] if isinstance(output, tuple) else output).dtype))

    with torch.nn.modules.module.register_module_forward_hook(attention_dtype):
        model, losses, grads, paths = _train_sharded(family, scheme, rank, mixed_precision="bf16")
    return {"losses": losses, "paths": paths, "grad_dtypes": sorted({str(grad.dtype) for grad in grads.values()}),
            "attention_dtypes": sorted(dtypes),
            "finite_grads": all(bool(torch.isfinite(grad).all()) for grad in grads.values())}


def _resume_run(rank: int, output: Path, start_from: Path | None) -> list[float]:
    """RESUMED trained sharded to RESUME_STEPS with a warm-up schedule, saving a DCP checkpoint half way; with
    ``start_from`` it first loads that checkpoint and trains the remaining steps. Returns the mean losses."""
    from hf_posswap.training.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from hf_posswap.training.sharding import shard_model

    model = shard_model(_model(*RESUMED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / RESUME_STEPS))
    first = 0
    if start_from is not None:
        first = load_sharded_checkpoint(start_from, model, optimizer, extra={"scheduler": scheduler})["step"]
    world = dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for step in range(first, RESUME_STEPS):
        loss = _loss(model, _batch(step)[rows])
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step + 1 == RESUME_STEPS // 2 and start_from is None:
            save_sharded_checkpoint(output, step + 1, model, optimizer, extra={"scheduler": scheduler})
    return losses


def _worker(rank: int, port: int, task: str, directory: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        root = Path(directory)
        results: dict = {}
        if task == "compare":
            for family, scheme in CASES:
                results[f"{family}-{scheme}"] = _compare_case(family, scheme, rank, root / f"{family}-{scheme}")
            for family, scheme in BF16_CASES:
                results[f"bf16-{family}-{scheme}"] = _bf16_case(family, scheme, rank)
            results["straight"] = _resume_run(rank, root / "run", None)
        else:
            from hf_posswap.training.sharded_checkpoint import latest_sharded_checkpoint

            for family, scheme in WIDE_CASES if task == "wide" else []:
                results[f"{family}-{scheme}"] = _compare_case(family, scheme, rank, root / f"wide-{family}-{scheme}")
            results["resumed"] = _resume_run(rank, root / "run", latest_sharded_checkpoint(root / "run"))
        if rank == 0:
            (root / f"{task}.json").write_text(json.dumps(results))
        dist.barrier()  # no process tears its connections down while another still works
    finally:
        dist.destroy_process_group()


def _spawn(task: str, directory: Path, world: int = WORLD) -> dict:
    """Run ``task`` in ``world`` fresh processes; what rank 0 wrote."""
    spawn(_worker, args=(free_port(), task, str(directory), world), processes=world)
    return json.loads((directory / f"{task}.json").read_text())


def _train_and_resume(directory: Path) -> dict:
    """``compare`` makes the 2-process checkpoint that ``resume`` (2 processes) and ``wide`` (WIDE) resume."""
    results = _spawn("compare", directory)
    results.update(_spawn("resume", directory))
    results["wide"] = _spawn("wide", directory, world=WIDE)
    results["directory"] = directory
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_again_if_killed(_train_and_resume, tmp_path_factory.mktemp("sharded"))


# --- the checks --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_sharded_steps_equal_one_process(runs: dict, family: str, scheme: str) -> None:
    _assert_trains_as_one_process(runs[f"{family}-{scheme}"], scheme)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), WIDE_CASES, ids=[f"{f}-{s}" for f, s in WIDE_CASES])
def test_four_processes_train_as_one_process(runs: dict, family: str, scheme: str) -> None:
    case = runs["wide"][f"{family}-{scheme}"]
    _assert_trains_as_one_process(case, scheme)
    assert case["reloaded_logits_diff"] < 1e-5


def _assert_trains_as_one_process(case: dict, scheme: str) -> None:
    assert len(case["sharded_losses"]) == STEPS
    assert case["sharded_losses"] == pytest.approx(case["alone_losses"], abs=1e-5)
    assert case["weights_diff"] < 1e-6  # every weight after the steps, position modules included
    assert case["position_weights_diff"] < 1e-6
    assert case["position_grad_diff"] < 1e-6
    if scheme in BIAS_SCHEMES:  # the swap's forward wrapper still runs under fully_shard's hooks
        assert case["paths"], case
    if scheme in ("t5", "kerple", "fire", "mix"):  # schemes with parameters: they are sharded and trained
        assert case["position_parameters"], case
        assert case["position_weights_moved"] > 1e-6  # trained (gpt2's T5 table moves least: 6e-6)
        assert case["position_weights_diff"] <= 1e-3 * case["position_weights_moved"]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_full_model_saved_from_shards_reloads_with_same_logits(runs: dict, family: str, scheme: str) -> None:
    case = runs[f"{family}-{scheme}"]
    described = {"mix": "layer_mix"}.get(scheme, scheme)
    assert case["reloaded_scheme"] == ("native" if (family, scheme) in NATIVE_PAIRS else described)
    assert case["reloaded_logits_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), BF16_CASES, ids=[f"{f}-{s}" for f, s in BF16_CASES])
def test_bf16_sharded_training_keeps_the_positions(runs: dict, family: str, scheme: str) -> None:
    case, full = runs[f"bf16-{family}-{scheme}"], runs[f"{family}-{scheme}"]
    assert case["paths"]  # the position context reached attention through the bf16 casts
    assert case["finite_grads"] and case["grad_dtypes"] == ["torch.float32"]
    assert case["attention_dtypes"] == ["torch.bfloat16"], case
    assert case["losses"] == pytest.approx(full["sharded_losses"], abs=2e-3)  # measured: within 1.5e-4


@pytest.mark.slow
def test_resume_from_sharded_checkpoint_gives_the_same_losses(runs: dict) -> None:
    straight, resumed = runs["straight"], runs["resumed"]
    assert len(straight) == RESUME_STEPS and len(resumed) == RESUME_STEPS // 2
    assert resumed == pytest.approx(straight[RESUME_STEPS // 2:], abs=1e-6)
    checkpoints = runs["directory"] / "run" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", f"step-{RESUME_STEPS // 2}"]


@pytest.mark.slow
def test_four_processes_resume_a_checkpoint_two_processes_saved(runs: dict) -> None:
    """Distributed checkpoints reshard on load: a run saved by 2 processes continues in 4 with the same losses."""
    assert runs["wide"]["resumed"] == pytest.approx(runs["straight"][RESUME_STEPS // 2:], abs=1e-6)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    from hf_posswap.training.sharded_checkpoint import (
        latest_sharded_checkpoint,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
    )

    model = swapped("llama", "t5")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _loss(model, _batch(0)).backward()
    optimizer.step()
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    first = save_sharded_checkpoint(tmp_path, 1, model, optimizer, trainer_state={"epoch": 0})

    def killed(state, checkpoint_id, **options):  # some shards written, then the process dies
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise KeyboardInterrupt

    with torch.no_grad():
        model.get_parameter("model.posswap_positions.tables.0.weight").add_(1.0)
    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_sharded_checkpoint(tmp_path, 2, model, optimizer)
    assert latest_sharded_checkpoint(tmp_path) == first
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-1"

    fresh = swapped("llama", "t5")
    state = load_sharded_checkpoint(first, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert state == {"step": 1, "epoch": 0}
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
