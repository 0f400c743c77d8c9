"""A virtual CUDA device for CPU-only machines: tensors that say they live on ``cuda:0`` and obey its rules.

``with VirtualCuda() as vc:`` makes ``vc.to_device(t)`` return a tensor whose ``.device`` is ``cuda:0`` (its data
stays in CPU memory). Inside the block every torch call is checked as CUDA would check it: a call that mixes a
virtual-CUDA tensor with a CPU tensor of more than zero dims raises :class:`DeviceMismatch` (naming the op), as
does ``.numpy()`` on a virtual-CUDA tensor; factory calls and ``.to`` with a CUDA device make virtual-CUDA
tensors, and the outputs of a call with a virtual-CUDA input are virtual-CUDA. So code that creates a constant
without ``device=`` and mixes it with the model's tensors fails here as it would on a GPU, with no GPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

CUDA = torch.device("cuda", 0)


class DeviceMismatch(RuntimeError):
    pass


class VirtualCudaTensor(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` (its class marks it; :class:`VirtualCuda` keeps the class going)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return CUDA

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False

    def __deepcopy__(self, memo):  # (prepare deep-copies the model; a parameter stays a parameter)
        if id(self) in memo:
            return memo[id(self)]
        new = torch.Tensor.clone(torch.Tensor.detach(self)).as_subclass(VirtualCudaTensor)
        if getattr(self, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        memo[id(self)] = new
        return new


def _wants_cuda(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


def _cpu_device(value):
    return torch.device("cpu") if isinstance(value, torch.device) else "cpu"


_TO_METHODS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
#: GEMMs CUDA has no integer kernels for ("addmm_cuda" not implemented for 'Long', ...)
_FLOAT_ONLY = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear",
               "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum"}
#: copies between devices are allowed (the destination keeps its device)
_COPIES = {torch.Tensor.copy_}


class VirtualCuda(TorchFunctionMode):
    """``strict=False``: record each mismatch (``self.mismatches``: message and the quantlens frame that made
    the call) and go on (the data are on the CPU either way), to list every one in one run."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.calls = 0
        self.strict = strict
        self.mismatches: list[str] = []

    def _fail(self, message: str) -> None:
        if self.strict:
            raise DeviceMismatch(message)
        import traceback

        frames = [f for f in traceback.extract_stack()[:-2] if "quantlens" in f.filename and "tests" not in f.filename]
        where = " <- ".join(f"{f.filename.split('src/')[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:3]) or "?"
        self.mismatches.append(f"{where}: {message}")

    @staticmethod
    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.as_subclass(VirtualCudaTensor)

    @staticmethod
    def is_virtual(t) -> bool:
        return isinstance(t, VirtualCudaTensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        self.calls += 1
        name = getattr(func, "__name__", repr(func))
        if func is torch.Tensor.numpy and isinstance(args[0], VirtualCudaTensor):
            self._fail("can't convert a cuda tensor to numpy (Tensor.numpy)")
        to_cuda = False
        if "device" in kwargs and _wants_cuda(kwargs["device"]):
            kwargs["device"] = _cpu_device(kwargs["device"])
            to_cuda = True
        args = list(args)
        if func in _TO_METHODS:
            if func is torch.Tensor.cuda:
                to_cuda, func, args = True, torch.Tensor.to, [args[0], "cpu"]
            elif func is torch.Tensor.cpu:
                return torch.Tensor.as_subclass(args[0], torch.Tensor)
            else:
                for i, a in enumerate(args[1:], 1):
                    if _wants_cuda(a):
                        args[i] = _cpu_device(a)
                        to_cuda = True
                    elif isinstance(a, (torch.device, str)) and not to_cuda:
                        # .to("cpu") of a virtual-CUDA tensor: back on the CPU
                        out = func(*args, **kwargs)
                        return torch.Tensor.as_subclass(out, torch.Tensor) if isinstance(out, torch.Tensor) else out
                    elif isinstance(a, torch.Tensor):  # .to(other): other's device
                        to_cuda = to_cuda or isinstance(a, VirtualCudaTensor)
                if not to_cuda and "device" in kwargs:  # .to(device="cpu")
                    out = func(*args, **kwargs)
                    return torch.Tensor.as_subclass(out, torch.Tensor) if isinstance(out, torch.Tensor) else out
        if func in _COPIES:
            return func(*args, **kwargs)
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        virtual = [x for x in leaves if isinstance(x, VirtualCudaTensor)]
        plain = [x for x in leaves if not isinstance(x, VirtualCudaTensor) and x.dim() > 0]
        if virtual and plain and func not in _TO_METHODS:
            self._fail(f"{name}: expected all tensors to be on the same device, but found cuda:0 and cpu "
                       f"(cpu tensor of shape {tuple(plain[0].shape)} {plain[0].dtype})")
        if virtual and name in _FLOAT_ONLY and any(not x.is_floating_point() for x in leaves):
            self._fail(f"{name}: not implemented on CUDA for integer tensors "
                       f"({', '.join(str(x.dtype) for x in leaves)})")
        out = func(*args, **kwargs)
        if not (virtual or to_cuda):
            return out
        return pytree.tree_map_only(torch.Tensor, self._mark, out)

    @staticmethod
    def _mark(t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, VirtualCudaTensor) else t.as_subclass(VirtualCudaTensor)


def module_to_virtual(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer of ``module`` on the virtual device, in place (``nn.Module.to`` keeps a
    Parameter's class, which would hide the device). Parameters stay parameters (``isinstance`` holds)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not isinstance(p, VirtualCudaTensor):
                m._parameters[name] = torch.nn.Parameter(p.detach().as_subclass(VirtualCudaTensor),
                                                         requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and not isinstance(b, VirtualCudaTensor):
                m._buffers[name] = b.as_subclass(VirtualCudaTensor)
    return module
