"""The RL core in one process with Ray unimportable (#20): engine, RL step on the torch backend, a bucketed weight
sync into the engine, and generation on the new weights, as a GPU box without Ray would run them.

    python tests/ray_free_core.py MODEL_DIR      # prints one JSON line; exits non-zero on any failure
"""

import importlib
import importlib.abc
import json
import socket
import sys


class NoRay(importlib.abc.MetaPathFinder):
    """Makes ``import ray`` fail, as on a machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"ray is not installed here ({name})")
        return None


# the Ray-free core besides what main() runs: these import without Ray too
CORE = [
    "miles_ray",
    "miles_ray.engines.loop",
    "miles_ray.engines.http_server",
    "miles_ray.backends.megatron_backend",
    "miles_ray.sync.broadcast",
    "miles_ray.sync.shm",
    "miles_ray.sync.digest",
    "miles_ray.placement.plan",
    "miles_ray.state_codec",
]


def main(model_path: str) -> dict:
    sys.meta_path.insert(0, NoRay())
    for name in CORE:
        importlib.import_module(name)
    import torch
    import torch.distributed as dist

    from miles_ray.backends import GRPOAdvantageConfig, OptimizerConfig, TorchBackendConfig, compute_advantages
    from miles_ray.backends.objectives import ObjectiveConfig
    from miles_ray.backends.rl_step import RLStep, logprobs
    from miles_ray.backends.torch_backend import TorchBackend
    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from miles_ray.engines.requests import GenerateRequest, SamplingParams
    from miles_ray.sync.buckets import unpack
    from miles_ray.types import RolloutBatch, Sample

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=model_path, max_batch_size=8, max_seq_len=64))
    backend = TorchBackend(TorchBackendConfig(parallel="ddp"), OptimizerConfig(lr=1e-2), model_path)
    prompt = [1, 50, 60, 70]
    [out] = engine.generate([GenerateRequest(prompt, SamplingParams(n=4, max_new_tokens=6, ignore_eos=True, seed=0))])
    samples = [
        Sample(prompt, c.token_ids, c.logprobs, reward=float(i % 2), group_id=0) for i, c in enumerate(out.completions)
    ]
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    before = logprobs(backend, batch, temperature=1.0)
    mask = batch.response_mask > 0
    engine_lps = torch.tensor([lp for s in samples for lp in s.rollout_logprobs])
    group = torch.zeros(len(samples), dtype=torch.long)
    batch.advantages = compute_advantages(GRPOAdvantageConfig(), batch.rewards, group, batch.response_mask)
    metrics = RLStep(backend, ObjectiveConfig()).update(batch)
    plan = backend.sync_plan(torch.float32, bucket_bytes=1 << 20)  # the sync's own buckets, packed and unpacked
    named = [kv for b in plan.buckets for kv in unpack(b, backend.gather_bucket(b, torch.float32))]
    engine.update_weights(named)
    after = logprobs(backend, batch, temperature=1.0)
    [again] = engine.generate([GenerateRequest(prompt, SamplingParams(n=4, max_new_tokens=6, ignore_eos=True, seed=0))])
    resampled = RolloutBatch.from_samples(
        [Sample(prompt, c.token_ids, c.logprobs) for c in again.completions], pad_id=0
    )
    trainer_new = logprobs(backend, resampled, temperature=1.0)[resampled.response_mask > 0]
    engine_new = torch.tensor([lp for c in again.completions for lp in c.logprobs])
    dist.destroy_process_group()
    return {
        "ray_imported": "ray" in sys.modules,
        "engine_vs_trainer_before": float((before[mask] - engine_lps).abs().max()),
        "grad_norm": float(metrics["grad_norm"]),
        "trainer_moved": float((after[mask] - before[mask]).abs().max()),
        "synced_tensors": len(named),
        "engine_vs_trainer_after_sync": float((trainer_new - engine_new).abs().max()),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
