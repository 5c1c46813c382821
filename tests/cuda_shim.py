"""A strict shim: on a CPU run, where every tensor would live on a CUDA run, and what nccl and the
device would then refuse or wait for.

On a CUDA run, a tensor made without a device (`torch.tensor(...)`, `torch.zeros(n)`), or by
`.cpu()` / `.to("cpu")`, lives on the host, and so does everything computed from it; a tensor
given a device object (`.to(dev)`, `device=x.device`) or made by the device's own kernels lives on
the GPU. nccl reduces only GPU tensors ("No backend type associated with device type cpu"), and a
GPU tensor read by the host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, a boolean-mask index)
makes the host wait for the device.

`CudaPlacement` tags host tensors as they are made (a TorchFunctionMode), and `strict_collectives`
wraps torch.distributed's collectives so that a host tensor given to one is recorded as a
violation: a 2-process gloo test then fails where the same code on nccl would. `placement.syncs`
counts the host reads of device tensors. On the CPU nothing of this changes a result.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.from_numpy}
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all_single",
               "all_to_all", "gather", "scatter", "send", "recv", "isend", "irecv")


def _is_host_device(d) -> bool:
    """A device argument that means the host on a CUDA run: the literal 'cpu' string (code that asks
    for the host); a torch.device object is taken as the run's own device, which is cuda there."""
    return isinstance(d, str) and d.startswith("cpu")


class CudaPlacement(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._host: dict[int, weakref.ref] = {}
        self.syncs: dict[str, int] = {}
        self.device_calls: dict[str, int] = {}  # functions called on a device tensor (first tensor argument)

    # ------------------------------------------------------------- tags
    def is_host(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _tag(self, out, host: bool) -> None:
        if isinstance(out, (tuple, list)):  # torch.return_types (sort, max, ...) are tuples too
            for o in out:
                self._tag(o, host)
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if host:
                    try:
                        self._host[id(t)] = weakref.ref(t)
                    except TypeError:
                        pass
                else:
                    self._host.pop(id(t), None)

    def host_count(self, name: str) -> None:
        self.syncs[name] = self.syncs.get(name, 0) + 1

    # ------------------------------------------------------------ mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        any_host = any(self.is_host(x) for x in inputs)
        if name in HOST_READS and inputs and not self.is_host(inputs[0]):
            self.host_count(name)
        if inputs and not self.is_host(inputs[0]):
            self.device_calls[name] = self.device_calls.get(name, 0) + 1
        if name in ("__getitem__", "__setitem__") and len(args) > 1:
            idx = args[1]
            for i in (idx if isinstance(idx, tuple) else (idx,)):
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool and not self.is_host(i):
                    self.host_count("bool-mask index")
        out = func(*args, **kwargs)
        if func in FACTORIES:
            host = kwargs.get("device") is None or _is_host_device(kwargs.get("device"))
        elif name == "cpu":
            host = True
        elif name in ("to", "cuda", "pin_memory"):
            dev = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (str, torch.device)) and not isinstance(a, torch.dtype):
                    dev = a
                elif isinstance(a, torch.Tensor):
                    dev = "host" if self.is_host(a) else torch.device("cpu")
            if dev is None:
                host = any_host if name == "to" else name == "pin_memory" or any_host
            else:
                host = dev == "host" or _is_host_device(dev)
                if not host and out is args[0] and self.is_host(out):
                    out = out.clone()  # a move to the device makes a new tensor there; the host one stays
        elif name in ("__get__",) and args and isinstance(args[0], torch.Tensor):
            host = any_host
        else:
            host = any_host
        self._tag(out, host)
        return out


class Collectives:
    """The calls made to torch.distributed's collectives, and those given a host tensor."""

    def __init__(self, placement: CudaPlacement):
        self.placement = placement
        self.calls: dict[str, int] = {}
        self.violations: list[str] = []
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real
            setattr(dist, name, self._wrap(name, real))
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)
        return False

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and self.placement.is_host(t):
                    self.violations.append(f"{name}: a host tensor {tuple(t.shape)} {t.dtype}")
            return real(*args, **kwargs)

        return call


def strict_collectives():
    """(placement mode, collectives recorder): enter both around the code under test."""
    placement = CudaPlacement()
    return placement, Collectives(placement)
