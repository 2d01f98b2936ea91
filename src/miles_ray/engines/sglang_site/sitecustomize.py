"""CPU shim for an SGLang server process (on its PYTHONPATH only with ``SGLangEngineConfig.device == "cpu"``).

Runs at interpreter start-up in the server and every process it spawns. Two import-time fixes, each applied
only where the real thing is missing, and never on GPU runs (the directory is not on their path):

- ``sgl_kernel``: SGLang's CPU code imports names from it at module load; its CPU build exists only from source
  for Intel AMX. When no ``sgl_kernel`` is installed, a stand-in module is provided whose every attribute is a
  function raising ``NotImplementedError``; without AMX, SGLang dispatches each layer to its native torch
  forward, so none is called (a call would fail loudly, never silently).
- ``torchvision``: PyPI's build links CUDA and cannot load beside a CPU torch, and then its import fails
  registering fake kernels for ``torchvision::nms``/``qnms``. When its library does not load, those two
  schemas are declared first, so ``torchvision.transforms`` (imported by SGLang's multimodal code) imports.
- pinned memory: SGLang's LoRA code (``sglang.srt.lora``, imported only with ``--enable-lora``) asks for pinned
  host buffers unconditionally, which torch refuses without an accelerator. When that package is imported on a
  host with none, ``pin_memory=True`` in torch's tensor factories is dropped and ``Tensor.pin_memory()`` returns a
  plain copy: pinning only speeds host-to-device copies, and there is no device.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _StandInKernel(types.ModuleType):
    __version__ = "0.0.0+miles_ray_standin"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name} was called: sgl_kernel is a stand-in on this CPU")

        missing.__name__ = name
        return missing


class _Fallbacks(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path`` for sgl_kernel (only reached when none is installed); first for torchvision."""

    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" and importlib.machinery.PathFinder.find_spec(name, path) is None:
            return importlib.util.spec_from_loader(name, self)
        if name == "torchvision":
            _declare_torchvision_ops(importlib.machinery.PathFinder.find_spec(name, path))
        if name == "sglang.srt.lora":
            _unpin_without_accelerator()
        return None

    def create_module(self, spec):
        return _StandInKernel(spec.name)

    def exec_module(self, module):
        pass


_keep = []


def _declare_torchvision_ops(spec) -> None:
    if spec is None or not spec.submodule_search_locations or _keep:
        return
    import glob
    import os

    import torch

    libs = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so"))
    try:
        if libs:
            torch.ops.load_library(libs[0])
            return
    except OSError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _keep.append(lib)  # the schemas live as long as the library object


_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided")


def _unpin_without_accelerator() -> None:
    import functools

    import torch

    if torch.accelerator.is_available() or getattr(torch, "_miles_ray_unpinned", False):
        return

    def unpinned(factory):
        @functools.wraps(factory)
        def call(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)

        return call

    for name in _PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, device=None: self.clone()
    torch._miles_ray_unpinned = True


sys.meta_path.insert(0, _Fallbacks())
