"""Weight sync: bucket plans, checksums and the two transports (gloo/NCCL broadcast, shared memory)."""

from miles_ray.sync.checksum import buckets_checksum, named_tensors_checksum
from miles_ray.sync.plan import Bucket, SyncPlan, TensorMeta, pack, plan_buckets, unpack

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
