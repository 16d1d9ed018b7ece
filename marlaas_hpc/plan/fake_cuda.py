"""A CUDA device on a CPU-only build of torch, for the GPU dry run (dry_run.py): the trainer's GPU path runs on fake
tensors that say device='cuda', allocate nothing, and count what a GPU would hold.

Fake tensors (`FakeTensorMode`) compute shapes, dtypes and devices without data, and raise
`FakeTensorDeviceMismatchError` when an op mixes a CPU tensor with a CUDA one, as CUDA would. What a CPU build of
torch 2.13 lacks around them is the CUDA runtime, in four places:

1. C++: no CUDA device guard (Python indexing `t[i]` of a CUDA tensor sets one: "PyTorch is not linked with
   support for cuda devices"), and no CUDA hooks, so autograd finds no accelerator for the stream bookkeeping of
   a backward on CUDA tensors ("Cannot access accelerator device when none is available"). `SHIM_SOURCE`
   registers both, doing nothing: one device, one default stream, events that complete at once. torch's own
   `ensureCUDADeviceGuardSet` installs such a no-op guard on a CUDA build without a GPU; a CPU build has none to
   replace. The library is compiled once with the system C++ compiler against torch's headers (`shim_library`)
   and must be loaded before torch is imported: torch caches its CUDA hooks at import (`install`).
2. Python `torch.cuda`: `is_available`, the current device, the RNG state megatron saves and restores around
   every attention call and recomputed layer, `synchronize` (`cuda_runtime`). RNG states are placeholders (fake
   tensors hold no random numbers anyway). Also one kernel choice a CPU build makes differently: on CUDA,
   `rms_norm` with input and weight of one dtype runs torch's fused kernel, which keeps its input and a float32
   rstd per row for backward; a CPU build always decomposes it (a float32 copy of the input kept). `cuda_runtime`
   routes CUDA calls of one dtype to a twin of the fused kernel (`fused_rms_norm_twin`) that keeps what it keeps.
3. Host reads of device values (`.item()`, `float(t)`, `if t:`): a fake tensor has no value. `MemoryCounter`
   answers each with 1 (1.0, True) and counts the CUDA ones: each is a device-to-host sync on a GPU.
4. FakeTensorMode keeps `torch.tensor(...)` on the host until moved (`FakeGpuMode.avoid_device_init`), as it does
   on a machine without a GPU, while `torch.cuda.is_available()` says True for the code under test.

`MemoryCounter` sums the bytes of live fake CUDA storages (freed through `weakref.finalize`): torch's MemTracker
aborts the process on a CPU-only build. Nothing here imports torch at module level: `install` must run first.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import shutil
import subprocess
import sys
import weakref
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

SHIM_SOURCE = r"""
// The CUDA runtime pieces a CPU-only torch lacks, as no-ops (marlaas_hpc/plan/fake_cuda.py).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

Stream default_stream() { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }

struct NoGpuGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return default_stream(); }
  Stream getNewStream(Device, int) const override { return default_stream(); }
  Stream exchangeStream(Stream) const noexcept override { return default_stream(); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
};

struct CUDAHooks final : at::CUDAHooksInterface {
  explicit CUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return false; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  int getNumGPUs() const override { return 1; }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, NoGpuGuard);
namespace at {
REGISTER_CUDA_HOOKS(CUDAHooks);
}
"""


class FakeCudaError(RuntimeError):
    """The fake CUDA runtime cannot be set up here (no C++ compiler, torch imported too early...)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise FakeCudaError("torch is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def shim_library(cache_dir: Path) -> Path:
    """The compiled shim for this torch (built once: ~1 s with g++), keyed by torch's location and the source."""
    torch_dir = _torch_dir()
    key = hashlib.sha256((SHIM_SOURCE + str(torch_dir.resolve())).encode()).hexdigest()[:16]
    library = cache_dir / f"fake_cuda_{key}.so"
    if library.is_file():
        return library
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FakeCudaError("the GPU dry run compiles a small C++ shim and found no C++ compiler (g++); "
                            "Debian: apt-get install g++")
    cache_dir.mkdir(parents=True, exist_ok=True)
    source = cache_dir / f"fake_cuda_{key}.cpp"
    source.write_text(SHIM_SOURCE)
    partial = library.with_suffix(".so.partial")
    lib = torch_dir / "lib"
    command = [compiler, "-O1", "-shared", "-fPIC", "-std=c++20", "-w", f"-I{torch_dir / 'include'}", str(source),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(partial)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise FakeCudaError(f"compiling the fake CUDA shim failed:\n{proc.stderr[-3000:]}")
    partial.replace(library)  # atomic: a concurrent dry run never loads half a library
    return library


_INSTALLED: list[Path] = []


def install(cache_dir: Path) -> None:
    """Loads the shim into this process (once); before anything imports torch (torch caches its CUDA hooks at
    import)."""
    if _INSTALLED:
        return
    if "torch" in sys.modules:
        raise FakeCudaError("the fake CUDA shim must be loaded before torch is imported (run the dry run in a "
                            "process of its own: python -m marlaas_hpc.plan.dry_run)")
    library = shim_library(cache_dir)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _INSTALLED.append(library)


@contextmanager
def cuda_runtime() -> Iterator[None]:
    """torch.cuda as the trainer sees it on a one-GPU rank (CUDA_VISIBLE_DEVICES narrowed to its GPU)."""
    import torch
    import torch._dynamo  # noqa: F401  (imported later, it would index the replacements below as torch's own)

    def rng_state(device="cuda"):
        return torch.zeros(16, dtype=torch.uint8)  # the size of a Philox state; its value is never read

    def ignore():
        return lambda *args, **kwargs: None

    replacements = {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                    "set_device": ignore(), "synchronize": ignore(), "get_rng_state": rng_state,
                    "set_rng_state": ignore(), "manual_seed": ignore(), "manual_seed_all": ignore(),
                    "_lazy_call": ignore()}  # callbacks for a CUDA init that never comes
    with ExitStack() as stack:
        for name, value in replacements.items():
            stack.enter_context(replaced(torch.cuda, name, value))
        for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
            stack.enter_context(replaced(torch.cuda.random, name, replacements[name]))
        stack.enter_context(replaced(torch.nn.functional, "rms_norm",
                                     fused_rms_norm_twin(torch.nn.functional.rms_norm)))
        yield


def fused_rms_norm_twin(rms_norm, on=lambda input: input.is_cuda):
    """`torch.nn.functional.rms_norm` as a CUDA build runs it: CUDA input and weight of one dtype go to the fused
    kernel (aten::_fused_rms_norm), anything else to `rms_norm` as given (the decomposition, and its dtype-mismatch
    warning). The twin holds what the kernel holds: its output and a float32 rstd per row in forward, its input,
    weight and rstd kept for backward (torch's derivatives), and in backward the input's gradient (and the
    weight's, when it requires one); on fake tensors, which have no values, it allocates just those (the kernel
    computes in registers), and on real ones it computes them. `on(input)` says which inputs are the device's (a
    test passes CPU tensors through the twin)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    def rstd_of(x, dims, eps):
        if isinstance(x, FakeTensor):
            return x.new_empty(x.shape[:x.dim() - len(dims)] + (1,) * len(dims), dtype=torch.float32)
        return torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)

    class FusedRmsNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, normalized_shape, eps):
            ctx.dims = tuple(range(-len(normalized_shape), 0))
            rstd = rstd_of(x, ctx.dims, torch.finfo(x.dtype).eps if eps is None else eps)
            out = torch.empty_like(x) if isinstance(x, FakeTensor) else (x.float() * rstd * weight.float()).to(x.dtype)
            ctx.save_for_backward(x, weight, rstd)
            return out

        @staticmethod
        def backward(ctx, grad):
            x, weight, rstd = ctx.saved_tensors
            if isinstance(x, FakeTensor):
                grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
                return torch.empty_like(x), grad_weight, None, None
            normed, grad = x.float() * rstd, grad.float()
            grad_normed = grad * weight.float()
            grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(ctx.dims, keepdim=True))
            grad_weight = (grad * normed).sum(tuple(range(grad.dim() - weight.dim()))).to(weight.dtype) \
                if ctx.needs_input_grad[1] else None
            return grad_x.to(x.dtype), grad_weight, None, None

    def twin(input, normalized_shape, weight=None, eps=None):
        if weight is not None and on(input) and weight.dtype == input.dtype:
            return FusedRmsNorm.apply(input, weight, tuple(normalized_shape), eps)
        return rms_norm(input, normalized_shape, weight, eps)

    return twin


@contextmanager
def replaced(owner, name: str, value) -> Iterator[None]:
    """`owner.name` is `value` inside the block."""
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


def fake_gpu_mode():
    """A FakeTensorMode for a machine whose CUDA is fake: `torch.tensor` stays on the host until moved, and real
    host tensors that torch creates outside dispatch (the CPU RNG state megatron compares around each attention
    call) enter as fake CPU tensors. Fake CPU and fake CUDA tensors still refuse to mix."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class FakeGpuMode(FakeTensorMode):
        # higher-order ops (FlexAttention) key their rules by the exact mode type; FakeTensorMode's own dispatch
        # runs their registered fake implementations
        supports_higher_order_operators = True

        @property
        def avoid_device_init(self) -> bool:
            return True

    return FakeGpuMode(allow_non_fake_inputs=True)


def memory_counter():
    """A MemoryCounter (a TorchDispatchMode subclass: built after torch is imported)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    scalar_read = torch.ops.aten._local_scalar_dense.default

    class MemoryCounter(TorchDispatchMode):
        """Bytes of live fake CUDA storages (`live`, `peak`), ops run and device-to-host reads (`host_syncs`)."""

        supports_higher_order_operators = True  # FlexAttention: its fake implementation sits below this mode

        def __init__(self):
            super().__init__()
            self.live = self.peak = self.ops = self.host_syncs = 0
            self._sizes: dict[int, int] = {}

        def reset_peak(self) -> None:
            self.peak = self.live

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            if func is scalar_read:
                tensor = args[0]
                self.host_syncs += tensor.device.type == "cuda"
                if tensor.dtype == torch.bool:
                    return True
                return 1.0 if tensor.dtype.is_floating_point else 1
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                    self._count(tensor.untyped_storage())
            return out

        def _count(self, storage) -> None:
            key = storage._cdata  # one StorageImpl, however many views and Python wrappers
            if key in self._sizes:
                return
            size = storage.nbytes()
            self._sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)

        def _free(self, key: int) -> None:
            self.live -= self._sizes.pop(key)

    return MemoryCounter()
