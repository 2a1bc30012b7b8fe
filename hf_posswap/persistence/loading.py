"""Checked loading of a user-given model path, for every CLI command.

``inspect_model_path(path)`` reads only small files (``config.json``, ``adapter_config.json``, the
``posswap_adapter.json`` record, safetensors headers; see :mod:`hf_posswap.persistence.user_files`) and refuses a
missing, corrupt or truncated checkpoint with one message naming the file and the fix, before any weights load.
``load_model(source)`` then loads it:

- a checkpoint directory (plain or hf_posswap) through the Auto class of its saved architecture;
- a LoRA adapter directory (``adapter_config.json``, as ``hf-posswap finetune --lora`` writes it): the base from
  ``base_model_name_or_path``, swapped as ``posswap_adapter.json`` records, then :func:`hf_posswap.load_adapter`;
- a Hugging Face Hub id (when the path does not exist and reads like one).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import PosSwapError, one_line
from .user_files import check_safetensors, check_torch_file, pickled_objects_message, read_json

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")
#: files that hold a vocabulary: a tokenizer loads from one of them (``tokenizer_config.json`` alone does not)
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")
#: files a tokenizer saves beside its vocabulary
TOKENIZER_COMPANIONS = ("special_tokens_map.json", "merges.txt", "spiece.model", "added_tokens.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")


class CheckpointError(PosSwapError, ValueError):
    """A model path that is missing, is not a checkpoint, or holds a corrupt or truncated file."""


@dataclass
class ModelSource:
    """What a model path holds, read from its small files only."""

    path: str
    kind: str  # "checkpoint", "adapter" or "hub"
    config: dict[str, Any] = field(default_factory=dict)
    base: ModelSource | None = None
    record: dict[str, Any] | None = None  # posswap_adapter.json of an adapter
    adapter_config: dict[str, Any] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        """The family's own model type (``gpt2`` for an ``hf_posswap_gpt2`` checkpoint)."""
        config = self.base.config if self.base is not None else self.config
        return str(config.get("model_type", "")).removeprefix("hf_posswap_")

    def is_causal(self) -> bool:
        """Whether the model predicts the next token (an encoder such as BERT does not)."""
        config = self.base.config if self.base is not None else self.config
        from ..transformers_internals import causal_lm_class_names

        if self.model_type == "bert" or self.model_type == "roberta":
            return bool(config.get("is_decoder", False))
        return self.model_type in causal_lm_class_names()


def inspect_model_path(value: str | os.PathLike[str], flag: str = "--model") -> ModelSource:
    """Validate a model path from its small files; raises :class:`CheckpointError` naming the file and the fix."""
    text = str(value)
    path = Path(text).expanduser()
    if not text.strip():
        raise CheckpointError(f"{flag} is empty; give a checkpoint directory.")
    try:
        exists = path.exists()
    except OSError as error:  # a name too long, a permission on a parent
        raise CheckpointError(f"{flag} {text!r}: {error.strerror or error}; give a checkpoint directory.") from error
    if not exists:
        if _HUB_ID.match(text) and not text.startswith((".", "~")):
            return ModelSource(text, "hub", _hub_config(text, flag))
        raise CheckpointError(
            f"{flag} {text!r}: no such directory. Give a checkpoint directory (config.json + weights), an adapter "
            "directory (adapter_config.json) or a Hugging Face Hub id."
        )
    if not path.is_dir():
        raise CheckpointError(f"{flag} {text!r} is a file; give the directory that holds config.json and the weights.")
    if (path / ADAPTER_CONFIG).exists():
        return _inspect_adapter(path, text, flag)
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"{flag} {text!r} has no config.json (nor {ADAPTER_CONFIG}): not a checkpoint directory. Give the "
            "directory written by save_pretrained."
        )
    config = read_json(path / "config.json", flag)
    _check_model_type(config, path / "config.json")
    _check_config_values(config, path / "config.json")
    keys = _check_weights(path, WEIGHT_FILES, flag, text)
    from .restore import check_checkpoint_keys

    check_checkpoint_keys(config, keys, repr(text))  # position weights under a plain model_type would be dropped
    return ModelSource(text, "checkpoint", config)


def _check_model_type(config: dict[str, Any], path: Path) -> None:
    from ..transformers_internals import config_mapping

    model_type = config.get("model_type")
    known = isinstance(model_type, str) and model_type.removeprefix("hf_posswap_") in config_mapping()
    if not known:
        raise CheckpointError(
            f"{str(path)!r} has model_type {model_type!r}, which transformers does not know; restore config.json "
            "(e.g. 'gpt2', 'bert', 'llama', or 'hf_posswap_<family>' for a swapped checkpoint)."
        )


#: the ``dtype`` values of config.json a model can be built in
LOADABLE_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _check_config_values(config: dict[str, Any], path: Path) -> None:
    """Build the config class from ``config`` (no weights): a value of the wrong type or an inconsistent pair
    (``"hidden_size": "big"``) is refused here, naming the file, instead of as a traceback while loading."""
    from huggingface_hub.errors import StrictDataclassError

    from ..transformers_internals import config_mapping

    for key in ("dtype", "torch_dtype"):  # transformers builds the model in this dtype before reading a weight
        if config.get(key) not in (None, "auto", *LOADABLE_DTYPES):
            raise CheckpointError(
                f"{str(path)!r} holds \"{key}\": {config[key]!r}, which is not a dtype a model is built in "
                f"({', '.join(LOADABLE_DTYPES)}). Set it to the dtype the weights were saved in."
            )
    config_class = config_mapping()[str(config["model_type"]).removeprefix("hf_posswap_")]
    try:
        built = config_class.from_dict({key: value for key, value in config.items() if key != "model_type"})
    except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError) as error:
        message = " ".join(str(error).split())
        raise CheckpointError(f"{str(path)!r} holds an invalid value: {message}. Restore config.json.") from error
    length = getattr(built, "max_position_embeddings", None)  # GPT-2 calls it n_positions
    if isinstance(length, bool) or (isinstance(length, int) and length < 1):
        raise CheckpointError(
            f"{str(path)!r} gives the model {length!r} positions (max_position_embeddings, n_positions for GPT-2); "
            "restore the length the model was trained at."
        )


def _check_weights(path: Path, names: tuple[str, ...], flag: str, text: str) -> list[str]:
    """Check the weight files from their headers; return the tensor names of safetensors files (else [])."""
    present = [name for name in names if (path / name).exists()]
    if not present:
        raise CheckpointError(f"{flag} {text!r} holds no weights (none of {', '.join(names)}); re-save the model.")
    name = present[0]
    if name.endswith(".index.json"):
        index = read_json(path / name, flag)
        shards = sorted(set((index.get("weight_map") or {}).values()))
        missing = [shard for shard in shards if not (path / shard).exists()]
        if not shards or missing:
            raise CheckpointError(f"{flag}: {str(path / name)!r} names missing weight files {missing or '(none)'}; "
                                  "copy them back or re-save the model.")
        keys = []
        for shard in shards:
            if shard.endswith(".safetensors"):
                keys += check_safetensors(path / shard)
        return keys
    if name.endswith(".safetensors"):
        return check_safetensors(path / name)
    check_torch_file(path / name)
    return []


def _hub_config(repo_id: str, flag: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(repo_id).to_dict()
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{flag} {repo_id!r} is neither a local directory nor a Hugging Face Hub model that could be loaded "
            f"(offline, or a typo?): {str(error).splitlines()[0]}"
        ) from error


def _inspect_adapter(path: Path, text: str, flag: str) -> ModelSource:
    from .adapters import ADAPTER_RECORD

    adapter_config = read_json(path / ADAPTER_CONFIG, flag)
    _check_weights(path, ADAPTER_WEIGHT_FILES, flag, text)
    record = read_json(path / ADAPTER_RECORD, flag) if (path / ADAPTER_RECORD).exists() else None
    if record is not None:
        _check_adapter_record(record, path / ADAPTER_RECORD)
    elif "posswap_positions" in (adapter_config.get("modules_to_save") or []):
        raise CheckpointError(
            f"{flag} {text!r} holds trained hf_posswap position modules but no {ADAPTER_RECORD} saying which swap "
            "they belong to; restore that file (hf_posswap.save_adapter writes it)."
        )
    base_name = adapter_config.get("base_model_name_or_path")
    if not isinstance(base_name, str) or not base_name:
        raise CheckpointError(
            f"{str(path / ADAPTER_CONFIG)!r} has no base_model_name_or_path; set it to the base checkpoint's path."
        )
    base_path = base_name if Path(base_name).expanduser().exists() or not (path / base_name).exists() else str(
        path / base_name
    )
    if (Path(base_path).expanduser() / ADAPTER_CONFIG).exists():  # checked before reading it: it may name this one
        itself = Path(base_path).expanduser().resolve() == path.resolve()
        raise CheckpointError(
            f"{str(path / ADAPTER_CONFIG)!r} names {'its own directory' if itself else 'another adapter'} as its base "
            f"({base_name!r}); set base_model_name_or_path to the checkpoint the adapter was trained on."
        )
    try:
        base = inspect_model_path(base_path, flag=f"{flag} {text!r}: base model")
    except CheckpointError as error:
        raise CheckpointError(
            f"{error} (named by base_model_name_or_path in {str(path / ADAPTER_CONFIG)!r}; edit it if the base moved)"
        ) from error
    return ModelSource(text, "adapter", base.config, base, record, adapter_config)


def _check_adapter_record(record: dict[str, Any], path: Path) -> None:
    scheme, extension = record.get("scheme"), record.get("extension")
    scheme_ok = scheme is None or (isinstance(scheme, dict) and isinstance(scheme.get("scheme"), str))
    if not scheme_ok or not (extension is None or isinstance(extension, dict)) or "scheme" not in record:
        raise CheckpointError(
            f"{str(path)!r} is malformed: expected {{'scheme': null or {{'scheme': name, ...}}, 'extension': null or "
            f"{{...}}}}, got {record!r}. Restore the file written with the adapter."
        )
    from ..schemes.base import SCHEME_REGISTRY

    name = scheme.get("scheme") if isinstance(scheme, dict) else None
    if name is not None and name not in SCHEME_REGISTRY.names():
        raise CheckpointError(f"{str(path)!r} names the unknown scheme {name!r} (known: "
                              f"{', '.join(SCHEME_REGISTRY.names())}); restore the file written with the adapter.")


def load_model(source: ModelSource, task: str = "saved", merge: bool = False, dtype: str = "auto") -> nn.Module:
    """Load what :func:`inspect_model_path` found. ``task``: ``"causal"`` (a causal LM head) or ``"saved"`` (the
    saved architecture). An adapter is loaded onto its swapped base; ``merge`` folds it into the weights.
    ``dtype``: ``"auto"`` (as saved) or a dtype name such as ``"float32"``."""
    if source.kind == "adapter" and source.base is not None:
        base = load_model(source.base, _adapter_task(source, task), dtype=dtype)
        model = _attach_adapter(base, source)
        return _merge(model, source) if merge else model
    from ..core.native import check_loaded
    from .autoload import register

    register()  # the hf-posswap command registers only now (its --help must not need torch)
    auto = _auto_class(source, task)
    try:
        model, report = auto.from_pretrained(source.path, output_loading_info=True, dtype=dtype)
        _refuse_dropped_weights(report.get("unexpected_keys") or [], source)
        check_loaded(model)  # a swap record loaded as the plain family: its position weights were dropped
        return model
    except PosSwapError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        if "Weights only load failed" in str(error):  # torch.load(weights_only=True) met a pickled object
            raise CheckpointError(pickled_objects_message(source.path)) from error
        message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        if "mismatch" in message:
            message = ("its weights do not match its config.json (see the report above); restore the config.json "
                       "the weights were saved with")
        raise CheckpointError(f"Could not load the model in {source.path!r}: {message}") from error


def _refuse_dropped_weights(unexpected: list[str], source: ModelSource) -> None:
    """Weights in the files that the loaded class has no place for were dropped: the model would run (and be saved)
    without them, e.g. a causal LM's head loaded as the bare model."""
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        raise CheckpointError(
            f"{source.path!r}: {len(unexpected)} saved weights have no place in {source.config.get('model_type')} "
            f"as loaded ({shown}), so they would be dropped. Check that config.json's 'architectures' names the "
            "class the weights were saved from."
        )


def _adapter_task(source: ModelSource, task: str) -> str:
    return "causal" if task == "causal" or source.adapter_config.get("task_type") == "CAUSAL_LM" else "saved"


def _auto_class(source: ModelSource, task: str) -> type:
    """AutoModelForCausalLM for ``causal``; else the Auto class whose model is the saved architecture."""
    from transformers import AutoModelForCausalLM

    from ..transformers_internals import auto_model_class, config_mapping
    from .autoload import AUTO_CLASSES

    if task == "causal":
        return AutoModelForCausalLM
    config_class = config_mapping()[source.config["model_type"]]
    architecture = (source.config.get("architectures") or [""])[0].removeprefix("PosSwap")
    for auto in AUTO_CLASSES:
        model_class = auto_model_class(auto, config_class)
        if model_class is not None and model_class.__name__.removeprefix("PosSwap") == architecture:
            return auto
    # loading it as another class (AutoModel's bare model, say) would silently drop its head's weights
    classes = (auto_model_class(auto, config_class) for auto in AUTO_CLASSES)
    known = ", ".join(sorted({model_class.__name__ for model_class in classes if model_class is not None}))
    if not architecture:
        raise CheckpointError(
            f"{source.path!r}: config.json names no architecture ('architectures' is missing or empty), so which "
            f"weights it holds is unknown. Set \"architectures\" to the class the weights were saved from, one of: "
            f"{known}."
        )
    raise CheckpointError(
        f"{source.path!r}: config.json names the architecture {architecture!r}; hf-posswap loads "
        f"{source.config['model_type']} checkpoints as {known}, and loading it as another class would "
        "drop weights. Restore 'architectures' in config.json (or set it to one of those)."
    )


def _attach_adapter(base: nn.Module, source: ModelSource) -> nn.Module:
    """Swap ``base`` as the adapter's record says, then :func:`hf_posswap.load_adapter` (which checks it)."""
    from ..core.extend import replay_extension
    from ..core.state import swap_state
    from ..core.swap import swap, unswap
    from ..schemes.base import scheme_config_from_dict
    from .adapters import load_adapter

    record = source.record
    if record is not None:
        state = swap_state(base)
        current = (state.config.to_dict(), state.extension) if state is not None else (None, None)
        wanted = (record.get("scheme"), record.get("extension"))
        if json.loads(json.dumps(current)) != wanted:
            if wanted[0] is None:
                unswap(base)
            else:
                swap(base, scheme_config_from_dict(wanted[0]), replace=state is not None)
                if wanted[1]:
                    replay_extension(base, wanted[1])
    try:
        return load_adapter(base, source.path)
    except PosSwapError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise CheckpointError(f"Could not load the adapter in {source.path!r}: {error}") from error


def _merge(model: nn.Module, source: ModelSource) -> nn.Module:
    try:
        return model.merge_and_unload()
    except (ValueError, RuntimeError, AttributeError) as error:
        raise CheckpointError(f"Could not merge the adapter in {source.path!r} into its base: {error}") from error


def load_tokenizer(source: ModelSource, required: bool = False):
    """The tokenizer saved with the model (an adapter's own, else its base's); ``None`` when there is none and
    ``required`` is false. A tokenizer copied only in part (``tokenizer_config.json`` without a vocabulary) is
    refused naming the missing files, not with transformers' advice to install sentencepiece."""
    from transformers import AutoTokenizer

    from .autoload import register

    register()  # AutoTokenizer reads config.json too: a swapped model type must be known (no "type ``" warning)
    candidates = [source] + ([source.base] if source.base is not None else [])
    for candidate in candidates:
        if candidate.kind != "hub":
            present = tokenizer_files(candidate.path)
            if not present:
                continue
            _check_vocabulary(candidate.path, present)
        try:
            return AutoTokenizer.from_pretrained(candidate.path)
        except (OSError, ValueError, KeyError, TypeError) as error:
            if candidate.kind == "hub" and not required:
                return None
            raise CheckpointError(f"Could not load the tokenizer in {candidate.path!r}: {one_line(error)}") from error
    if required:
        raise CheckpointError(
            f"{source.path!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there. Copy the tokenizer "
            "files of the model it came from into it (or AutoTokenizer.from_pretrained(that_model)"
            f".save_pretrained({source.path!r}))."
        )
    return None


def tokenizer_files(path: str | os.PathLike[str]) -> list[str]:
    """The tokenizer files in a directory (``TOKENIZER_FILES`` and their companions)."""
    names = (*TOKENIZER_FILES, *TOKENIZER_COMPANIONS)
    return [name for name in names if (Path(path) / name).is_file()]


def _check_vocabulary(path: str, present: list[str]) -> None:
    """A tokenizer needs a vocabulary, not only its settings: name what is there and what is missing."""
    if any(name in VOCABULARY_FILES for name in present):
        return
    raise CheckpointError(
        f"{path!r} holds an incomplete tokenizer: {', '.join(present)} but no vocabulary (one of "
        f"{', '.join(VOCABULARY_FILES)}; vocab.json needs merges.txt). Copy the missing files from the model it came "
        "from, or re-save its tokenizer there with tokenizer.save_pretrained(dir)."
    )
