"""Rows of a dataset from JSONL, JSON, Parquet or HF ``datasets``, read whole and checked before a run starts.

Every reader returns a list of dicts (one per row). A malformed line names its line number, a row that is not an
object names its row; an empty dataset is an error. Readers import their library lazily: ``pyarrow`` for Parquet,
``datasets`` for a ``Dataset`` saved with ``save_to_disk`` or passed as an object.

Usage::

    rows = read_rows("train.jsonl")                     # format from the suffix
    rows = read_rows("hf_dir", split="test")            # a DatasetDict saved with save_to_disk
    rows = rows_of(datasets.Dataset.from_list([...]))   # an in-memory HF Dataset
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# what each format reads; "auto" picks by suffix (a directory is a saved HF dataset)
FORMATS = ("auto", "jsonl", "json", "parquet", "hf")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


def detect_format(path: Path) -> str:
    """The format of ``path`` from its suffix, or ``hf`` for a directory.

    Raises:
        ValueError: for an unknown suffix (lists the known ones).

    """
    if path.is_dir():
        return "hf"
    found = _SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its suffix: use one of {sorted(_SUFFIXES)}, "
            "a directory saved with datasets' save_to_disk, or set the format"
        )
    return found


def read_rows(path: str | Path, format: str = "auto", split: str = "train") -> list[dict[str, Any]]:
    """All rows of the dataset at ``path``.

    Args:
        path: a ``.jsonl``/``.json``/``.parquet`` file, or a directory saved with ``datasets``' ``save_to_disk``.
        format: one of ``FORMATS``; ``auto`` from the suffix.
        split: for a saved ``DatasetDict``, the split to read.

    Raises:
        ValueError: for a missing file, an unknown format, a malformed line or row, or an empty dataset.

    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset path {str(path)!r} does not exist")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    kind = detect_format(path) if format == "auto" else format
    if kind == "jsonl":
        rows = _read_jsonl(path)
    elif kind == "json":
        rows = _read_json(path)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        import datasets

        rows = rows_of(datasets.load_from_disk(str(path)), split)
    if not rows:
        raise ValueError(f"dataset {str(path)!r} has no rows")
    return rows


def rows_of(dataset: Any, split: str = "train") -> list[dict[str, Any]]:
    """The rows of an HF ``Dataset`` (or of ``split`` of a ``DatasetDict``) as dicts.

    Raises:
        ValueError: for a ``DatasetDict`` without ``split``, or an object that is neither.

    """
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"the dataset has splits {sorted(dataset.keys())}; split={split!r} is not one")
        dataset = dataset[split]
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"expected a datasets.Dataset or DatasetDict, got {type(dataset).__name__}")
    return dataset.to_list()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():  # blank lines (a trailing newline, a separator) carry no row
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON array of objects, or JSON lines under a ``.json`` name (as ``datasets`` reads both)."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return _read_jsonl(path)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: row {bad} must be a JSON object, got {type(rows[bad]).__name__}")
    return rows
