"""Whole-run checkpoints: trainer (and critic) weights + optimizer + RNG, buffer contents, data position, step.

One checkpoint is one directory ``root/step_<step>/``:

- ``trainer/``: torch DCP shards of model and optimizer, each rank's RNG, the weight version (``TrainerGroup.save``)
- ``critic/``: the same for a PPO critic, when given
- ``buffer.json`` (+ ``buffer.safetensors``): every group the ReplayBuffer holds, payloads included, and its counters
- ``data.json``: the data position: a data source's ``state_dict()`` (lockstep drivers) or a stopped
  ``AsyncRollout``'s ``state()`` (fully async drivers, with the prompts handed out but not in the buffer)
- ``driver_rng.json`` + ``driver_rng.safetensors``: the driver process's Python and torch RNG states
- ``run.json``: the format version, step, weight version, save time, the driver's ``extra`` dict and the sha256 of
  every other file; written last, so its presence marks a complete checkpoint.

No state is pickled (``miles_ray.state_codec``: JSON + safetensors, classes only from miles_ray), so loading a
checkpoint runs no code from it. ``load`` checks the format version and every file's sha256 before restoring
anything: a corrupted or missing file raises ``CheckpointCorruptError`` naming it. Format-1 checkpoints (pickled
state, before 2026-12-05) load only with ``allow_pickle=True``. ``keep_last`` keeps the most recently *saved*
checkpoints (after a rollback, step 6 saved after step 8 is newer than step 8), and a save first removes what
interrupted saves left.

Writes are atomic: everything goes into ``root/.tmp-step_<step>-<id>/``, which is renamed into place only when
complete, and then ``root/latest`` is replaced (write + rename). A crash during a save leaves the previous
checkpoint as the latest, usable as it was. On a multi-node cluster ``root`` must be a shared filesystem (the
trainer ranks write their shards there).

Usage::

    ckpt = RunCheckpointer("runs/grpo/checkpoints", keep_last=2)
    ckpt.save(step, trainer, buffer=buffer, data_source=task, extra={"best_reward": r})
    ...
    meta = ckpt.load(ckpt.latest(), trainer, buffer=buffer, data_source=task)   # meta["step"], meta["extra"]
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import time
import uuid
import warnings
from pathlib import Path

import ray
import torch

from miles_ray.state_codec import load_state, save_state

FORMAT = 2  # 1: buffer/data/RNG state pickled (.pkl); 2: JSON + safetensors (state_codec)


class RunCheckpointer:
    """Saves and finds whole-run checkpoints under ``root``; keeps the newest ``keep_last`` of them."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root, self.keep_last = Path(root), keep_last
        self.root.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        step: int,
        trainer,
        *,
        critic=None,
        buffer=None,
        async_rollout=None,
        data_source=None,
        extra: dict | None = None,
        rollout_worker=None,
    ) -> Path:
        """Checkpoint the run after ``step``; returns the checkpoint directory.

        Args:
            step: the driver's step count (restored by ``load``).
            trainer: the ``TrainerGroup``.
            critic: a PPO ``CriticGroup``, if any.
            buffer: the ``ReplayBuffer``, if its contents must survive (async runs hold groups across steps).
            async_rollout: a stopped ``AsyncRollout`` (async runs): its data source and unsent prompts.
            data_source: the driver's data source (lockstep runs), with ``state_dict()``.
            extra: JSON-serialisable driver state.
            rollout_worker: the deprecated name of ``async_rollout``.

        Raises:
            ValueError: if both ``async_rollout`` and ``data_source`` are given (neither: no data position saved).
            TypeError: if ``data_source`` has no ``state_dict()``.
            Anything a part raises: the previous checkpoint stays the latest.

        """
        async_rollout = _renamed(async_rollout, rollout_worker)
        if async_rollout is not None and data_source is not None:
            raise ValueError("give async_rollout (async runs) or data_source (lockstep runs), not both")
        for old in self.root.glob(".tmp-*"):  # leftovers of a save (or of a re-save's swap) that was interrupted
            shutil.rmtree(old, ignore_errors=True)
        name = f"step_{step:08d}"
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        ray.get(trainer.save.remote(str(tmp / "trainer")))
        if critic is not None:
            ray.get(critic.save.remote(str(tmp / "critic")))
        parts = ["trainer"] + (["critic"] if critic is not None else [])
        if buffer is not None:
            save_state(tmp / "buffer", ray.get(buffer.state.remote()))
            parts.append("buffer")
        if async_rollout is not None:
            save_state(tmp / "data", {"kind": "async_rollout", "state": ray.get(async_rollout.state.remote())})
            parts.append("data")
        elif data_source is not None:
            if not hasattr(data_source, "state_dict"):
                raise TypeError(f"{type(data_source).__name__} has no state_dict(): its position cannot be saved")
            save_state(tmp / "data", {"kind": "data_source", "state": data_source.state_dict()})
            parts.append("data")
        save_state(tmp / "driver_rng", {"python": random.getstate(), "torch": torch.get_rng_state()})
        meta = {
            "format": FORMAT,
            "step": step,
            "weight_version": ray.get(trainer.weight_version.remote()),
            "time": time.time(),
            "has": parts,
            "extra": extra or {},
            "sha256": _digests(tmp),
        }
        _write_bytes(tmp / "run.json", json.dumps(meta, indent=2).encode())  # last: marks the checkpoint complete
        _fsync_dir(tmp)
        final = self.root / name
        trash = None
        if final.exists():  # re-saving a step (after a resume): swap, never leave no complete copy on disk
            trash = self.root / f".tmp-old-{name}-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
        tmp.rename(final)
        _write_bytes(self.root / "latest", name.encode(), atomic=True)
        _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        for stale in self.complete()[: -self.keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoint directories, the least recently saved first."""
        done = [p for p in self.root.glob("step_*") if (p / "run.json").exists()]
        return sorted(done, key=lambda p: (_saved_at(p), p.name))

    def latest(self) -> Path | None:
        """The newest complete checkpoint (``root/latest`` when it names one), or None."""
        pointer = self.root / "latest"
        if pointer.exists():
            named = self.root / pointer.read_text().strip()
            if (named / "run.json").exists():
                return named
        done = self.complete()
        return done[-1] if done else None

    def load(
        self,
        path: str | os.PathLike | None,
        trainer,
        *,
        critic=None,
        buffer=None,
        async_rollout=None,
        data_source=None,
        restore_driver_rng: bool = True,
        rollout_worker=None,
        allow_pickle: bool = False,
    ) -> dict:
        """Restore what ``save`` wrote into the given actors and data source; returns ``run.json``.

        ``path`` None means ``latest()``. The trainer must have been built with the same model (any rank count:
        DCP reshards; the RNG of ranks beyond the saved count is left as seeded). ``allow_pickle`` reads a
        format-1 checkpoint, whose state files are pickles: only for files you trust, as unpickling runs code.

        Raises:
            FileNotFoundError: if there is no complete checkpoint there, or it lacks a part asked for.
            CheckpointCorruptError: if a file is missing or its sha256 differs (before anything is restored).

        """
        async_rollout = _renamed(async_rollout, rollout_worker)
        path = Path(path) if path is not None else self.latest()
        if path is None or not (path / "run.json").exists():
            raise FileNotFoundError(f"no complete checkpoint at {path or self.root}")
        meta = json.loads((path / "run.json").read_text())
        if meta.get("format", 0) > FORMAT:
            raise CheckpointCorruptError(f"{path} is format {meta['format']}; this miles_ray reads up to {FORMAT}")
        read = _state_reader(path, meta.get("format", 0), allow_pickle)
        _verify(path, meta.get("sha256"))
        asked = {"critic": critic, "buffer": buffer, "data": async_rollout or data_source}
        held = [name.removesuffix(".pkl") for name in meta["has"]]  # format 1 listed files
        missing = [part for part, target in asked.items() if target is not None and part not in held]
        if missing:
            raise FileNotFoundError(f"checkpoint {path} has no {missing} (it holds {held})")
        ray.get(trainer.load.remote(str(path / "trainer")))
        if critic is not None:
            ray.get(critic.load.remote(str(path / "critic")))
        if buffer is not None:
            ray.get(buffer.load_state.remote(read("buffer")))
        if async_rollout is not None or data_source is not None:
            data = read("data")
            kind = "async_rollout" if data["kind"] == "rollout_worker" else data["kind"]  # its name until 2026-12
            want = "async_rollout" if async_rollout is not None else "data_source"
            if kind != want:
                raise ValueError(f"checkpoint {path} saved the data position of a {kind}, not a {want}")
            if async_rollout is not None:
                ray.get(async_rollout.load_state.remote(data["state"]))
            else:
                data_source.load_state_dict(data["state"])
        if restore_driver_rng:
            rng = read("driver_rng")
            random.setstate(rng["python"])
            torch.set_rng_state(rng["torch"])
        return meta


class CheckpointCorruptError(ValueError):
    """A checkpoint's file is missing, altered, or of a newer format."""


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative POSIX path -> hex)."""
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, expected: dict[str, str] | None) -> None:
    """Raise ``CheckpointCorruptError`` naming the first file that is missing or differs from ``expected``."""
    if expected is None:  # written before checksums (format 1 without "sha256"): nothing to compare with
        return
    for name, digest in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint {path} is missing {name}")
        if _sha256(file) != digest:
            raise CheckpointCorruptError(f"checkpoint {path}: {name} does not match its sha256 (corrupted or altered)")


def _saved_at(path: Path) -> float:
    try:
        return float(json.loads((path / "run.json").read_text()).get("time", 0.0))
    except (OSError, ValueError):
        return 0.0


def _renamed(async_rollout, rollout_worker):
    """``async_rollout``, or the one given under its deprecated name ``rollout_worker`` (with a warning)."""
    if rollout_worker is None:
        return async_rollout
    warnings.warn(
        "RunCheckpointer: rollout_worker= is deprecated: use async_rollout=", DeprecationWarning, stacklevel=3
    )
    if async_rollout is not None:
        raise ValueError("give async_rollout only (rollout_worker is its deprecated name)")
    return rollout_worker


def _state_reader(path: Path, version: int, allow_pickle: bool):
    """``read(part)`` for a checkpoint of format ``version``; format 1 (pickles) only with ``allow_pickle``."""
    if version >= 2:
        return lambda part: load_state(path / part)
    if not allow_pickle:
        raise ValueError(
            f"checkpoint {path} is format {version}: its buffer, data and RNG state are pickles, and unpickling runs "
            "code from the file; pass allow_pickle=True only if you trust every file in it (then save again)"
        )

    def read_pickle(part: str):
        with open(path / f"{part}.pkl", "rb") as f:
            return pickle.load(f)  # noqa: S301 (asked for with allow_pickle=True)

    return read_pickle


def _write_bytes(path: Path, data: bytes, atomic: bool = False) -> None:
    target = path.with_name(path.name + ".tmp") if atomic else path
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
