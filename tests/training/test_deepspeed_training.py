"""``finetune`` with an accelerate config that asks for DeepSpeed ZeRO-3, over 2 gloo processes on CPU (DeepSpeed's
CPU accelerator), equals ``finetune`` in one process: the same losses, the same weights after the steps (position
parameters included, FIRE's 0-dim ones too, sharded and trained like any weight), a final model gathered from the
shards that reloads with its scheme, a resume from a DeepSpeed checkpoint that continues with the same losses,
LoRA, bf16 mixed precision (DeepSpeed then holds bf16 weights: close to one process's bf16 run, not equal), and a
process killed while it writes its partition of a checkpoint, after which the run resumes from the one before.

One spawn of 2 processes runs every DeepSpeed case; two more kill a run while it saves and resume it. The one-process
references run in the test process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import NATIVE_PAIRS, save_tiny_checkpoint, write_corpus
from process_launch import KilledBySignal, free_port, run_again_if_killed, spawn

import hf_posswap as ps

pytest.importorskip("deepspeed")

WORLD = 2
BATCH = 4  # rows per optimizer step: BATCH // WORLD per process under DeepSpeed
STEPS = 4
CASES = [("llama", "t5"), ("llama", "kerple"), ("llama", "fire"), ("llama", "learned"), ("llama", "rope"),
         ("gpt2", "alibi"), ("gpt2", "t5"), ("gpt2", "fire")]
TRAINED_POSITIONS = {"t5", "kerple", "fire", "learned"}  # schemes with position parameters
RESUMED = ("llama", "kerple")  # resumed from its DeepSpeed checkpoint at step STEPS // 2
KILLED = "killed-during-save"  # RESUMED again, killed while saving its last checkpoint, then resumed
LORA = ("llama", "t5")
BF16 = ("llama", "t5")  # also trained with mixed_precision "bf16" (DeepSpeed then holds the weights in bf16)
#: ZeRO-3 with every parameter partitioned: DeepSpeed keeps parameters under stage3_param_persistence_threshold
#: elements whole in every process, which would leave a tiny model unsharded
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def _settings(root: Path, family: str, scheme: str, output: Path, **options) -> dict:
    # a decaying schedule with warm-up: it must advance once per update in every process (DeepSpeed's engine steps it)
    return {"model": str(root / family), "data": [str(root / "corpus" / "*.txt")], "output": str(output),
            "scheme": scheme, "seq_len": 32, "steps": STEPS, "lr": 2e-3, "warmup_steps": 1,
            "save_every": STEPS // 2, "eval_every": 0, "gradient_checkpointing": True, "progress": False, **options}


def _losses(output: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output / "loss_log.jsonl").read_text().splitlines()]


def _learning_rates(output: Path) -> list[float]:
    return [json.loads(line)["lr"] for line in (output / "loss_log.jsonl").read_text().splitlines()]


# --- what every process runs -------------------------------------------------------------------------------------


def _zero3(root: Path, family: str, scheme: str, output: Path, **options) -> dict:
    """``finetune`` under ZeRO-3 (a fresh accelerate state: a launched process keeps its state between runs)."""
    from accelerate.state import AcceleratorState

    from hf_posswap.training import FinetuneConfig, finetune

    AcceleratorState._reset_state()
    config = FinetuneConfig(**_settings(root, family, scheme, output, batch_size=BATCH // WORLD,
                                        accelerate_config=str(root / "zero3.yaml"), **options))
    return finetune(config)


def _resume_from_half_way(root: Path, straight: Path) -> Path:
    """The straight run's directory as it was after the checkpoint at STEPS // 2 (rank 0 copies it), resumed."""
    import torch.distributed as dist

    resumed = root / "resumed"
    if dist.get_rank() == 0:
        shutil.copytree(straight, resumed)
        shutil.rmtree(resumed / "final")
        shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS}")
        (resumed / "checkpoints" / "latest").write_text(f"step-{STEPS // 2}")
    dist.barrier()
    _zero3(root, *RESUMED, resumed, resume=True)
    return resumed


def _die_while_saving(step: int) -> None:
    """This process is killed (SIGKILL) as it writes its first DeepSpeed file of step ``step``'s checkpoint, after
    the first bytes of it."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original = TorchCheckpointEngine.save

    def write_part_then_die(self, state_dict, path: str) -> None:
        if f".staging-step-{step}" not in str(path):
            return original(self, state_dict, path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"the first bytes of a partition")
        os.kill(os.getpid(), signal.SIGKILL)

    TorchCheckpointEngine.save = write_part_then_die


def _worker(rank: int, port: int, root: str, task: str) -> None:
    """``compare``: every DeepSpeed case; ``killed``: the RESUMED run, its process 1 killed while saving the last
    checkpoint; ``resume-killed``: that run resumed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    directory = Path(root)
    results: dict = {}
    if task == "killed":
        if rank == 1:
            _die_while_saving(STEPS)
        _zero3(directory, *RESUMED, directory / KILLED)
    elif task == "resume-killed":
        results = _zero3(directory, *RESUMED, directory / KILLED, resume=True)
    else:
        for family, scheme in CASES:
            results[f"{family}-{scheme}"] = _zero3(directory, family, scheme, directory / f"zero3-{family}-{scheme}")
        results["resumed"] = str(_resume_from_half_way(directory, directory / f"zero3-{RESUMED[0]}-{RESUMED[1]}"))
        results["lora"] = _zero3(directory, *LORA, directory / "zero3-lora", lora=True)
        results["bf16"] = _zero3(directory, *BF16, directory / "zero3-bf16", mixed_precision="bf16")
    if rank == 0:
        (directory / f"{task}.json").write_text(json.dumps(results))


def _spawn(root: Path, task: str) -> dict:
    spawn(_worker, args=(free_port(), str(root), task), processes=WORLD)
    return json.loads((root / f"{task}.json").read_text())


def _kill_while_saving(root: Path) -> None:
    """The ``killed`` spawn, which must end with process 1 killed by SIGKILL (any other signal: run again)."""
    try:
        spawn(_worker, args=(free_port(), str(root), "killed"), processes=WORLD)
    except KilledBySignal as killed:
        if "process 1 ended by SIGKILL" not in str(killed):  # gloo's crash instead: the whole fixture runs again
            raise
    else:
        raise AssertionError("process 1 was not killed while it saved")
    files = sorted(str(path.relative_to(root / KILLED)) for path in (root / KILLED).rglob("*"))
    (root / f"{KILLED}-before-resume.json").write_text(json.dumps(files))


#: DeepSpeed's CPU communication op, compiled by torch's extension loader in the first process that starts DeepSpeed
SHM_OP = "deepspeed_shm_comm"
#: a build lock older than this is stale: the build takes about a minute, and a run killed while building leaves its
#: lock behind, which makes every later DeepSpeed start wait for it forever
STALE_LOCK_SECONDS = 900


def _refuse_a_stale_build_lock() -> None:
    """Fail at once, naming the file, where a killed build left torch's lock on DeepSpeed's op (a hang otherwise).
    Looked up where torch's extension loader builds (``TORCH_EXTENSIONS_DIR``, else its default root), creating
    nothing."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    for lock in root.glob(f"*/{SHM_OP}/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # a build elsewhere just finished
            continue
        if age > STALE_LOCK_SECONDS:
            pytest.fail(f"{lock} is a stale build lock (a build of {SHM_OP} was killed, and DeepSpeed would wait for "
                        "it forever); delete it and run again", pytrace=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD:  # DeepSpeed then takes a GPU per process
        pytest.skip(f"needs {WORLD} GPUs, or none (DeepSpeed's CPU accelerator over gloo)")
    _refuse_a_stale_build_lock()
    return run_again_if_killed(_train, tmp_path_factory.mktemp("zero3"))


def _train(root: Path) -> dict:
    from hf_posswap.training import FinetuneConfig, finetune

    for family in ("llama", "gpt2"):
        save_tiny_checkpoint(family, root / family)
    (root / "corpus").mkdir()
    write_corpus(root / "corpus")
    (root / "zero3-deepspeed.json").write_text(json.dumps(ZERO3))
    (root / "zero3.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                     f"  deepspeed_config_file: {root / 'zero3-deepspeed.json'}\n")
    results = _spawn(root, "compare")
    _kill_while_saving(root)
    results["resumed-killed"] = _spawn(root, "resume-killed")
    for family, scheme, lora in [*((f, s, False) for f, s in CASES), (*LORA, True)]:
        output = root / (f"alone-{family}-{scheme}" + ("-lora" if lora else ""))
        results[output.name] = finetune(FinetuneConfig(**_settings(root, family, scheme, output, batch_size=BATCH,
                                                                  lora=lora)))
    output = root / f"alone-{BF16[0]}-{BF16[1]}-bf16"
    results[output.name] = finetune(FinetuneConfig(**_settings(root, *BF16, output, batch_size=BATCH,
                                                              mixed_precision="bf16")))
    results["root"] = root
    return results


# --- the checks --------------------------------------------------------------------------------------------------


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert all(a[k].shape == b[k].shape for k in a), [k for k in a if a[k].shape != b[k].shape]
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_zero3_steps_equal_one_process(runs: dict, family: str, scheme: str) -> None:
    root = runs["root"]
    zero3, alone = root / f"zero3-{family}-{scheme}", root / f"alone-{family}-{scheme}"
    result, reference = runs[f"{family}-{scheme}"], runs[f"alone-{family}-{scheme}"]
    assert result["steps"] == STEPS
    # the trained weights' sum, gathered from the partitions (an ungathered ZeRO-3 parameter sums to 0)
    assert result["parameter_checksum"] == pytest.approx(reference["parameter_checksum"], rel=1e-4)
    assert _losses(zero3) == pytest.approx(_losses(alone), abs=1e-5)  # measured: within 4e-6
    sharded, whole = _weights(zero3 / "final"), _weights(alone / "final")
    # AdamW moves a weight by about lr whatever its gradient's size, so a near-zero gradient that differs in its
    # last bits moves it visibly differently: every weight within 1e-3 (measured: 3.3e-4, lr 2e-3)
    assert _max_diff(sharded, whole) < 1e-3
    if scheme in TRAINED_POSITIONS:  # sharded and trained like any weight (FIRE's 0-dim ones held as [1])
        half_way = _weights(alone / "checkpoints" / f"step-{STEPS // 2}")
        positions = [name for name in whole if "posswap_positions" in name]
        moved = {name: _max_diff({name: whole[name]}, {name: half_way[name]}) for name in positions}
        # a parameter whose gradient is rounding noise (FIRE's output bias: softmax ignores a bias equal for every
        # key) moves by less; the others moved 1.4e-3 .. 4e-3 over the last steps
        trained = [name for name in positions if moved[name] > 1e-4]
        assert trained, moved
        if scheme == "fire":
            assert {name.rsplit(".", 1)[1] for name in trained} >= {"c", "threshold_scale"}
        for name in trained:  # measured: within 3.4e-3 * moved (gpt2's T5 table)
            assert _max_diff({name: sharded[name]}, {name: whole[name]}) <= 1e-2 * moved[name], name


@pytest.mark.slow
@pytest.mark.parametrize(("family", "scheme"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_zero3_final_model_is_the_gathered_shards_and_reloads_with_its_scheme(runs: dict, family: str,
                                                                              scheme: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    root = runs["root"]
    zero3 = root / f"zero3-{family}-{scheme}"
    saved = _weights(zero3 / "final")
    # the last checkpoint (at the last step) consolidated from every process's ZeRO-3 partitions by DeepSpeed
    shards = get_fp32_state_dict_from_zero_checkpoint(str(zero3 / "checkpoints" / f"step-{STEPS}"),
                                                      tag="pytorch_model")
    tied = set(shards) - set(saved)  # GPT-2's head, tied to the embedding, is written once
    assert tied <= {"lm_head.weight"} and set(saved) <= set(shards)
    # FIRE's 0-dim parameters, held as [1] by DeepSpeed, are written back 0-dim
    assert _max_diff(saved, {name: shards[name].reshape(saved[name].shape) for name in saved}) == 0.0
    sharded = AutoModelForCausalLM.from_pretrained(zero3 / "final").eval()
    alone = AutoModelForCausalLM.from_pretrained(root / f"alone-{family}-{scheme}" / "final").eval()
    assert ps.describe(sharded).scheme == ("native" if (family, scheme) in NATIVE_PAIRS else scheme)
    tokens = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        difference = (sharded(input_ids=tokens).logits - alone(input_ids=tokens).logits).abs().max()
    assert float(difference) < 1e-3  # measured: 2.1e-4 (the AdamW spread above)


@pytest.mark.slow
def test_zero3_resume_from_a_deepspeed_checkpoint_gives_the_same_losses(runs: dict) -> None:
    from hf_posswap.training.run_checkpoints import checkpoints_newest_first

    root, resumed = runs["root"], Path(runs["resumed"])
    straight = root / f"zero3-{RESUMED[0]}-{RESUMED[1]}"
    assert _losses(resumed) == pytest.approx(_losses(straight), abs=1e-6)
    valid, rejected = checkpoints_newest_first(straight)
    assert [path.name for path, _ in valid] == [f"step-{STEPS}", f"step-{STEPS // 2}"] and not rejected
    assert (straight / "checkpoints" / f"step-{STEPS}" / "pytorch_model").is_dir()  # DeepSpeed's own files
    assert _max_diff(_weights(resumed / "final"), _weights(straight / "final")) < 1e-6


@pytest.mark.slow
def test_a_process_killed_while_writing_its_partition_loses_nothing(runs: dict) -> None:
    """The last save died half-written in its staging folder: the step STEPS // 2 checkpoint stayed the latest, and
    the resumed run continued from it with the uninterrupted run's losses and final weights."""
    root = runs["root"]
    before = json.loads((root / f"{KILLED}-before-resume.json").read_text())
    assert f"checkpoints/step-{STEPS // 2}/trainer_state.json" in before, before
    assert any(name.startswith(f"checkpoints/.staging-step-{STEPS}/") for name in before), before
    assert f"checkpoints/step-{STEPS}" not in before and "final" not in before
    assert runs["resumed-killed"]["first_step"] == STEPS // 2 and runs["resumed-killed"]["steps"] == STEPS
    straight = root / f"zero3-{RESUMED[0]}-{RESUMED[1]}"
    assert _losses(root / KILLED) == pytest.approx(_losses(straight), abs=1e-6)
    assert _max_diff(_weights(root / KILLED / "final"), _weights(straight / "final")) < 1e-6
    assert not any(path.name.startswith(".staging") for path in (root / KILLED / "checkpoints").iterdir())


@pytest.mark.slow
def test_zero3_lora_trains_the_adapter_and_the_position_parameters(runs: dict) -> None:
    from safetensors.torch import load_file

    root = runs["root"]
    zero3, alone = root / "zero3-lora", root / f"alone-{LORA[0]}-{LORA[1]}-lora"
    assert _losses(zero3) == pytest.approx(_losses(alone), abs=1e-5)
    assert _learning_rates(zero3) == pytest.approx(_learning_rates(alone), rel=1e-12)
    sharded = load_file(zero3 / "adapter" / "adapter_model.safetensors")
    whole = load_file(alone / "adapter" / "adapter_model.safetensors")
    assert any("posswap_positions" in name for name in whole)
    assert _max_diff(sharded, whole) < 1e-3  # AdamW's spread, as above (measured: 1.1e-5)


@pytest.mark.slow
def test_zero3_bf16_trains_close_to_one_process_and_saves_a_model_that_reloads(runs: dict) -> None:
    from transformers import AutoModelForCausalLM

    root = runs["root"]
    zero3, alone = root / "zero3-bf16", root / f"alone-{BF16[0]}-{BF16[1]}-bf16"
    assert runs["bf16"]["steps"] == STEPS
    # one process keeps float32 weights under autocast; DeepSpeed's bf16 holds bf16 weights (float32 master copies in
    # the optimizer), so the losses agree to bf16's precision, not exactly
    assert _losses(zero3) == pytest.approx(_losses(alone), rel=5e-3)  # measured: within 1.6e-4
    assert _learning_rates(zero3) == pytest.approx(_learning_rates(alone), rel=1e-12)
    saved = _weights(zero3 / "final")
    assert {value.dtype for value in saved.values()} == {torch.bfloat16}  # DeepSpeed's bf16 weights, as held
    assert all(bool(torch.isfinite(value).all()) for value in saved.values())
    whole, half_way = _weights(alone / "final"), _weights(alone / "checkpoints" / f"step-{STEPS // 2}")
    positions = [name for name in whole if "posswap_positions" in name]
    moved = _max_diff({n: whole[n] for n in positions}, {n: half_way[n] for n in positions})
    apart = _max_diff({n: saved[n].float() for n in positions}, {n: whole[n] for n in positions})
    # trained as in one process, bf16's rounding of the tables included (measured: 1.3e-4 apart, 1.8e-3 moved)
    assert positions and apart < 0.5 * moved
    model = AutoModelForCausalLM.from_pretrained(zero3 / "final").eval()
    reference = AutoModelForCausalLM.from_pretrained(alone / "final").eval()
    assert ps.describe(model).scheme == BF16[1]
    tokens = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits, expected = model(input_ids=tokens).logits.float(), reference(input_ids=tokens).logits
    assert float((logits - expected).abs().max()) < 0.1 * float(expected.abs().max())
