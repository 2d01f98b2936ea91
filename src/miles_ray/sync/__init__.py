"""Weight sync: bucket plans (``buckets``), checksums, the transports (``broadcast`` over gloo/NCCL, ``shm``)."""

from miles_ray.sync.buckets import Bucket, SyncPlan, TensorMeta, pack, plan_buckets, unpack
from miles_ray.sync.checksum import buckets_checksum, named_tensors_checksum

__all__ = [
    "Bucket",
    "buckets_checksum",
    "SyncPlan",
    "TensorMeta",
    "named_tensors_checksum",
    "pack",
    "plan_buckets",
    "unpack",
]
