"""One process of ``hf_posswap.training.finetune`` runs sharded by accelerate's own FSDP2 code, launched by
``accelerate launch --multi_gpu`` (torchrun) on CPU over gloo; ``test_accelerate_fsdp.py`` starts it.

accelerate shards only on accelerators: on CPU it picks plain data parallelism (``DistributedType.MULTI_CPU``) and
``finetune`` refuses an FSDP config there. This worker, and only this worker, lets accelerate's FSDP2 path run over
gloo all the same: :func:`let_accelerate_shard_on_cpu` turns the state's MULTI_CPU into FSDP once a plugin is given
(accelerate's ``prepare``, ``save_state``, ``load_state`` and ``get_state_dict`` then take their FSDP branches, which
call PyTorch's ``fully_shard`` and distributed checkpoint, both of which run over gloo), and tells ``finetune`` that
sharding is possible here.

Usage: ``worker.py RUNS.json`` where RUNS.json is a list of ``{"config": {FinetuneConfig fields},
"stop_after_checkpoint": step or null, "kill_during_save": step or null, "report": path}``, run in order in the same
processes (a run stopped after a checkpoint writes no report; a kill during a save ends the launch)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def let_accelerate_shard_on_cpu() -> None:
    import accelerate.state
    from accelerate.utils import DistributedType

    import hf_posswap.training.accelerate_config as accelerate_config

    original = accelerate.state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:
            self.fsdp_plugin = fsdp_plugin
        # every AcceleratorState() call copies the partial state's MULTI_CPU back in: turn it into FSDP each time
        if getattr(self, "fsdp_plugin", None) is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP

    accelerate.state.AcceleratorState.__init__ = init
    accelerate_config.accelerate_can_shard = lambda: True


class StopRun(Exception):
    """Raised in every process right after a chosen checkpoint: the run ends there, as a killed one would."""


def stop_after_checkpoint(step: int | None) -> None:
    """End the next run right after the checkpoint of ``step`` is published (``None``: do not stop)."""
    import hf_posswap.training.loop as loop

    original = getattr(loop._save_checkpoint, "original", loop._save_checkpoint)

    def save_then_stop(accelerator, output, position):
        path = original(accelerator, output, position)
        if position["step"] == step:
            raise StopRun(step)
        return path

    save_then_stop.original = original
    loop._save_checkpoint = save_then_stop


def kill_during_save(step: int | None) -> None:
    """Process 1 dies by SIGKILL inside the distributed-checkpoint write of ``step``'s checkpoint, after writing part
    of its model shard; process 0 is then stopped by torchrun while it waits for it (``None``: no kill)."""
    import torch.distributed.checkpoint as dcp

    import hf_posswap.training.loop as loop
    from hf_posswap.training.run_checkpoints import staging_dir

    if step is None or os.environ.get("LOCAL_RANK") != "1":
        return
    original_checkpoint = loop._save_checkpoint

    def save_checkpoint(accelerator, output, position):
        if position["step"] == step:
            shard = staging_dir(Path(output), step) / "pytorch_model_fsdp_0" / "__1_0.distcp"

            def write_part_then_die(*args, **kwargs):
                shard.parent.mkdir(parents=True, exist_ok=True)
                shard.write_bytes(b"the first bytes of a shard")
                os.kill(os.getpid(), signal.SIGKILL)

            dcp.save = write_part_then_die
        return original_checkpoint(accelerator, output, position)

    save_checkpoint.original = getattr(original_checkpoint, "original", original_checkpoint)
    loop._save_checkpoint = save_checkpoint


def main(runs_file: str) -> None:
    let_accelerate_shard_on_cpu()
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    from hf_posswap.training import FinetuneConfig, finetune

    for run in json.loads(open(runs_file, encoding="utf-8").read()):
        AcceleratorState._reset_state()  # a launched process runs one finetune; here each run sets its own precision
        stop_after_checkpoint(run.get("stop_after_checkpoint"))
        kill_during_save(run.get("kill_during_save"))
        try:
            result = finetune(FinetuneConfig(**run["config"]))
        except StopRun:
            continue
        state = PartialState()
        if state.is_main_process:
            with open(run["report"], "w", encoding="utf-8") as handle:
                json.dump({**result, "processes": state.num_processes, "sharded": _sharded()}, handle)


def _sharded() -> bool:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    return AcceleratorState().distributed_type == DistributedType.FSDP


if __name__ == "__main__":
    main(sys.argv[1])
