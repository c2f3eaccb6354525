"""One Triton kernel launch as data, so that what runs is also what the compile check compiles.

triton_quant's launchers build a `Launch` (kernel, grid, runtime arguments, constexprs, compile
options) and hand it to `run`. `recording()` collects the launches instead of running them, and
`compile_launch` compiles one for a GPU target with the JIT's own specialization of the
arguments (types, 16-divisibility, ints equal to 1 made constant), which needs no GPU: that is
how tests/test_kernels_compile.py compiles, for sm_90 and sm_100, exactly the variants a
quantize or dequantize call launches, and checks their PTX (kernels/ptx_rules.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

# The compile options of every launch. Bytes must equal the torch reference's, which rounds
# every FP32 product and sum on its own and keeps subnormals, so (kernels/ptx_rules.py):
# - no FP contraction: without it LLVM emits mul.rn/add.rn, which ptxas may not fuse into an
#   FMA (it may fuse a plain mul.f32 + add.f32, and LLVM itself emits fma.rn.f32 for a*b+c);
# - no flush-to-zero in libdevice calls (tl.floor becomes cvt.rmi.ftz.f32 otherwise).
EXACT_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@dataclass(frozen=True)
class Launch:
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple  # the runtime arguments, in the kernel's order
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=lambda: dict(EXACT_OPTIONS))

    @property
    def name(self) -> str:
        return self.kernel.__name__


_recorded: list[Launch] | None = None


def run(launch: Launch) -> None:
    if _recorded is not None:
        _recorded.append(launch)
        # A dry run: outputs read back on the host (non-finite flags, partial amax) are zeros,
        # as after a launch on all-zero inputs, so the caller carries on to its next launch.
        for a in launch.args:
            if isinstance(a, torch.Tensor):
                a.zero_()
        return
    launch.kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options)


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Collect the launches made inside the block instead of running them (not thread-safe:
    for tests and tools, which call the launchers with small CPU tensors)."""
    global _recorded
    saved, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = saved


def _specialize(launch: Launch, backend) -> tuple:
    """(options, signature, constexprs, attrs) as JITFunction.run derives them from these
    arguments (triton.runtime.jit: the binder, then _pack_args)."""
    kernel = launch.kernel
    kwargs = {**launch.constexprs, **launch.options}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


def compile_key(launch: Launch, arch: int) -> str:
    """What distinguishes two compiled variants: the kernel and its specialized signature,
    constexprs, attributes and options for one target."""
    options, signature, constexprs, attrs = _specialize(launch, make_backend(GPUTarget("cuda", arch, 32)))
    return repr((launch.name, arch, signature, sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(launch.options.items())))


def compile_launch(launch: Launch, arch: int):
    """triton.compile of this launch for CUDA compute capability `arch` (90, 100, ...): a
    CompiledKernel whose `.asm` holds "ptx" and "cubin" (ptxas ships with triton's nvidia
    backend). Raises what the compiler raises (CompilationError, PTXASError)."""
    target = GPUTarget("cuda", arch, 32)
    options, signature, constexprs, attrs = _specialize(launch, make_backend(target))
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
