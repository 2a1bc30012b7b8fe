"""Training data: local text / jsonl files or a ``datasets`` dataset saved to disk, tokenized and packed into
fixed-length sequences (concatenate, then cut; an EOS token between documents)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..errors import InvalidConfigError


def expand_paths(patterns: Sequence[str]) -> list[Path]:
    """Files named by paths or glob patterns, sorted for determinism; directories of ``datasets`` stay as is."""
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise InvalidConfigError(f"No training data matches '{pattern}'. Pass text/jsonl files or a directory.")
        paths.extend(Path(match) for match in matches)
    return paths


def read_documents(paths: Iterable[Path], text_field: str = "text") -> list[str]:
    """Documents from .txt files (one per file), .jsonl files (``text_field`` of each line), .json files (JSON Lines
    or a list of records), or a ``datasets`` dataset directory saved with ``save_to_disk``.
    Unreadable, binary or malformed files raise :class:`InvalidConfigError` naming the file (and the line, for
    jsonl)."""
    documents: list[str] = []
    for path in paths:
        if path.is_dir():
            documents.extend(_dataset_documents(path, text_field))
        elif path.suffix.lower() == ".jsonl":
            documents.extend(_jsonl_documents(path, text_field))
        elif path.suffix.lower() == ".json":
            documents.extend(_json_documents(path, text_field))
        else:
            documents.append(_read_text(path))
    if not any(document.strip() for document in documents):
        raise InvalidConfigError("The training data holds no text; pass non-empty text/jsonl files.")
    return documents


def _read_text(path: Path) -> str:
    """A UTF-8 file's text (a byte-order mark, as some editors write, is dropped); only regular files are read."""
    if path.exists() and not path.is_file():
        raise InvalidConfigError(f"Data file {path} is not a regular file (a device or pipe); pass text/jsonl files.")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise InvalidConfigError(
            f"Data file {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
            "pass UTF-8 .txt or .jsonl files."
        ) from None
    except OSError as error:
        raise InvalidConfigError(f"Data file {path} cannot be read ({error.strerror or error}); check the path and "
                                 "its permissions.") from None


def _json_documents(path: Path, text_field: str) -> list[str]:
    """A ``.json`` file as ``datasets`` writes and reads one: JSON Lines (``Dataset.to_json``'s default), a list of
    records (``lines=False``) or a single record."""
    text = _read_text(path)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return _jsonl_documents(path, text_field, text)  # more than one value: one record per line
    if not isinstance(whole, list):
        whole = [whole]
    return [_record_text(record, text_field, f"{path} record {number}") for number, record in enumerate(whole, 1)]


def _jsonl_documents(path: Path, text_field: str, text: str | None = None) -> list[str]:
    documents = []
    text = _read_text(path) if text is None else text
    # "\n" only: JSON escapes a newline inside a string, while str.splitlines would also cut at the Unicode line
    # separators (U+2028, U+0085, ...) that JSON writes as they are
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidConfigError(
                f"{path}:{number} is not valid JSON ({error.msg} at column {error.colno}); each line must be one "
                f"JSON object with a '{text_field}' field."
            ) from None
        documents.append(_record_text(record, text_field, f"{path}:{number}"))
    return documents


def _record_text(record: object, text_field: str, where: str) -> str:
    """The text of one JSON record (an object with a string ``text_field``)."""
    if not isinstance(record, dict) or text_field not in record:
        raise InvalidConfigError(f"{where} has no '{text_field}' field; pass --text-field.")
    if not isinstance(record[text_field], str):
        raise InvalidConfigError(
            f"{where}: field '{text_field}' holds {type(record[text_field]).__name__}, not text; pass --text-field "
            "naming a string field."
        )
    return record[text_field]


def _dataset_documents(path: Path, text_field: str) -> list[str]:
    try:
        from datasets import load_from_disk
    except ImportError as error:
        raise InvalidConfigError(
            f"{path} is a directory; reading a `datasets` dataset needs `pip install datasets`."
        ) from error
    try:
        dataset = load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise InvalidConfigError(
            f"{path} is a directory but not a `datasets` dataset saved with save_to_disk ({type(error).__name__}); "
            f"pass its text files instead (e.g. '{path}/*.txt')."
        ) from None
    if hasattr(dataset, "keys"):  # a DatasetDict: take the train split, else the first one
        dataset = dataset["train"] if "train" in dataset else dataset[next(iter(dataset.keys()))]
    if text_field not in dataset.column_names:
        raise InvalidConfigError(
            f"The dataset in {path} has no '{text_field}' column (it has {', '.join(dataset.column_names)}); "
            "pass --text-field."
        )
    return [str(text) for text in dataset[text_field]]


class PackedDataset(Dataset):
    """Token blocks of exactly ``seq_len`` ids [seq_len] from the concatenated documents."""

    def __init__(self, token_ids: torch.Tensor, seq_len: int) -> None:
        blocks = token_ids.numel() // seq_len
        if blocks == 0:
            raise InvalidConfigError(
                f"The data has {token_ids.numel()} tokens, fewer than one sequence of {seq_len}; use more data or a "
                "shorter --seq-len."
            )
        self.blocks = token_ids[: blocks * seq_len].view(blocks, seq_len)  # [N, seq_len]

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index]}


def pack(documents: Sequence[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize every document, join with the EOS (or SEP) id, return one flat id tensor.

    Documents longer than the tokenizer's ``model_max_length`` are fine here (the flat tensor is cut into
    ``seq_len`` pieces), so transformers' warning about sequences longer than the model is turned off."""
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"])
        if separator is not None:
            ids.append(separator)
    return torch.tensor(ids, dtype=torch.long)


def train_eval_split(
    token_ids: torch.Tensor, seq_len: int, eval_fraction: float
) -> tuple[PackedDataset, PackedDataset | None]:
    """The last ``eval_fraction`` of the blocks is held out (at least one block when there are two or more)."""
    dataset = PackedDataset(token_ids, seq_len)
    held = int(len(dataset) * eval_fraction)
    if eval_fraction > 0 and held == 0 and len(dataset) > 1:
        held = 1
    if held == 0:
        return dataset, None
    train_ids = dataset.blocks[:-held].reshape(-1)
    eval_ids = dataset.blocks[-held:].reshape(-1)
    return PackedDataset(train_ids, seq_len), PackedDataset(eval_ids, seq_len)
