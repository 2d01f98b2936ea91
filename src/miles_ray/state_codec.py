"""Run state on disk without pickle: JSON for the structure, safetensors for the tensors.

A run checkpoint holds buffer contents, data positions and RNG states. Unpickling such a file runs whatever code
it names, so a checkpoint directory anyone else could write to would be a way in; this codec reads back only
data: JSON values, tuples, sets, bytes, non-string dict keys, torch tensors and numpy arrays (into a
``.safetensors`` file beside the JSON), and dataclasses defined in ``miles_ray`` itself (``Sample``,
``GroupRef``...), rebuilt field by field. Anything else fails at save time, naming where it sits.

Usage::

    save_state(path / "buffer", state)   # buffer.json (+ buffer.safetensors when it holds tensors)
    state = load_state(path / "buffer")
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
from pathlib import Path

import numpy as np
import torch

TAG = "__miles_ray__"  # marks an encoded non-JSON value; a plain dict using this key is encoded too
_ALLOWED_MODULES = "miles_ray."  # dataclasses are rebuilt only from the package's own modules


def save_state(stem: str | Path, obj) -> list[Path]:
    """Write ``obj`` to ``stem.json`` (and ``stem.safetensors`` when it holds arrays); returns the files written.

    Raises:
        TypeError: naming the path of a value the format does not hold (an arbitrary object).

    """
    from safetensors.torch import save_file

    stem = Path(stem)
    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(obj, tensors, "state")
    files = [stem.with_suffix(".json")]
    files[0].write_text(json.dumps({"format": 1, "state": doc}))
    if tensors:
        files.append(stem.with_suffix(".safetensors"))
        save_file(tensors, files[1])
    return files


def load_state(stem: str | Path):
    """Read what ``save_state`` wrote.

    Raises:
        ValueError: for a value no ``save_state`` writes (an unknown tag, a class outside miles_ray).

    """
    from safetensors.torch import load_file

    stem = Path(stem)
    doc = json.loads(stem.with_suffix(".json").read_text())
    arrays = stem.with_suffix(".safetensors")
    tensors = load_file(arrays) if arrays.exists() else {}
    return _decode(doc["state"], tensors)


def _encode(obj, tensors: dict, where: str):
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        items = [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]
        return {TAG: "dict", "items": items}
    if isinstance(obj, tuple | set | frozenset):
        kind = "tuple" if isinstance(obj, tuple) else "set"
        return {TAG: kind, "items": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, bytes):
        return {TAG: "bytes", "b64": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.Tensor | np.ndarray):
        key = f"t{len(tensors)}"
        numpy = isinstance(obj, np.ndarray)
        tensors[key] = (torch.from_numpy(np.ascontiguousarray(obj)) if numpy else obj.detach().cpu()).contiguous()
        return {TAG: "ndarray" if numpy else "tensor", "key": key}
    if isinstance(obj, np.generic):  # a numpy scalar: its Python value
        return _encode(obj.item(), tensors, where)
    cls = type(obj)
    if dataclasses.is_dataclass(obj) and cls.__module__.startswith(_ALLOWED_MODULES):
        fields = {f.name: _encode(getattr(obj, f.name), tensors, f"{where}.{f.name}") for f in dataclasses.fields(obj)}
        return {TAG: "dataclass", "type": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise TypeError(
        f"{where} is a {cls.__module__}.{cls.__qualname__}: checkpoint state holds JSON values, tuples, sets, bytes, "
        "tensors, numpy arrays and miles_ray dataclasses only (no pickle)"
    )


def _decode(doc, tensors: dict):
    if isinstance(doc, list):
        return [_decode(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        return doc
    kind = doc.get(TAG)
    if kind is None:
        return {k: _decode(v, tensors) for k, v in doc.items()}
    if kind in ("dict", "tuple", "set"):
        items = [_decode(v, tensors) for v in doc["items"]]
        return {"dict": dict, "tuple": tuple, "set": set}[kind](items)  # dict: from its [key, value] pairs
    if kind == "bytes":
        return base64.b64decode(doc["b64"])
    if kind in ("tensor", "ndarray"):
        tensor = tensors[doc["key"]]
        return tensor.numpy() if kind == "ndarray" else tensor
    if kind == "dataclass":
        return _dataclass(doc["type"])(**{k: _decode(v, tensors) for k, v in doc["fields"].items()})
    raise ValueError(f"checkpoint state holds an unknown value tag {kind!r}")


def _dataclass(spec: str) -> type:
    module, _, name = spec.partition(":")
    if not module.startswith(_ALLOWED_MODULES):
        raise ValueError(f"checkpoint state names the class {spec!r}; only miles_ray dataclasses are rebuilt")
    cls = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"checkpoint state names {spec!r}, which is not a dataclass")
    return cls
