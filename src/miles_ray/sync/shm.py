"""Shared-memory transport for colocated sync: buckets go through the Ray object store zero-copy.

``ray.put`` of a NumPy array writes it once into shared memory; ``ray.get`` on the same node maps it
without copying, so an engine reads the trainer's bucket straight from shared memory. (``ray.put`` of a
torch tensor would pickle it, several times slower.) bfloat16 has no NumPy dtype, so buckets travel as
raw bytes and are viewed back as their dtype.
"""

from __future__ import annotations

import warnings

import numpy as np
import ray
import torch


def put_bucket(flat: torch.Tensor) -> ray.ObjectRef:
    """Put a flat CPU tensor into the object store as a zero-copy NumPy byte array."""
    return ray.put(flat.contiguous().view(torch.uint8).numpy())


def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """View an object-store byte array (read-only) as a tensor of ``dtype`` without copying."""
    with warnings.catch_warnings():  # the array is read-only; we only read from it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(dtype)
