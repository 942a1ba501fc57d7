"""How the MPI backend hands tensors to MPI: zero-copy buffers, MPI datatypes and reductions, staged copies.

CPU tensors go to MPI as zero-copy buffers (the tensor's address and byte length with an explicit MPI datatype):
no pickling, no copies except where a dtype or layout forces one. float32/64, int8/16/32/64, uint8, bool and complex
travel with their MPI types. float16 and bfloat16 have no reduction in MPI-3 libraries: they move as 16-bit bit
patterns (all_gather, broadcast, send/recv: exact) and are reduced (all_reduce, reduce_scatter) on a float32 copy,
then rounded once to the tensor's dtype. That is as exact as a 16-bit reduction can be, but may differ in the last
bit from backends that accumulate in 16 bits. A non-contiguous tensor is likewise staged in a contiguous copy;
`finisher` writes the staged result back (and divides, for AVG) when the operation completes.

GPU tensors go to MPI directly only when the library is CUDA-aware (Open MPI's MPIX_Query_cuda_support, MPICH's
MPIX_GPU_query_support; SHARDWISE_MPI_CUDA_AWARE=1/0 overrides). The current CUDA stream is synchronised first,
since MPI does not order itself after kernels. Otherwise the operation raises CommError advising backend="nccl".
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

from .base import CommError, ReduceOp, check_reduce_op

__all__ = ["SIXTEEN_BIT", "cuda_aware_mpi", "finisher", "mpi_buffer", "mpi_reduction"]

_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
SIXTEEN_BIT = (torch.float16, torch.bfloat16)  # no MPI reduction: moved as int16 bits, reduced in float32
_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}
_BOOL_OPS = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND}


def cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library can read and write CUDA memory (see the module docstring)."""
    override = os.environ.get("SHARDWISE_MPI_CUDA_AWARE")
    if override in ("0", "1"):
        return override == "1"
    lib = ctypes.CDLL(None)  # mpi4py loaded libmpi with global symbols
    query = getattr(lib, "MPIX_Query_cuda_support", None)  # Open MPI
    if query is not None:
        return bool(query())
    query = getattr(lib, "MPIX_GPU_query_support", None)  # MPICH: (MPIX_GPU_SUPPORT_CUDA=0, int *supported)
    if query is not None:
        supported = ctypes.c_int(0)
        return query(0, ctypes.byref(supported)) == 0 and bool(supported.value)
    return False


def mpi_buffer(what: str, t: torch.Tensor, *, cuda_aware: bool, rank: int) -> list:
    """[memory, MPI datatype] over a contiguous tensor's storage, without copying (CPU) or through CUDA memory.

    The caller keeps `t` alive until the operation completes. `rank` is named in the error for a CUDA tensor when
    the library is not `cuda_aware`.
    """
    if t.dtype in SIXTEEN_BIT:
        datatype = MPI.INT16_T
    elif t.dtype in _TYPES:
        datatype = _TYPES[t.dtype]
    else:
        raise ValueError(f"{what}: dtype {t.dtype} is not supported by the mpi backend; "
                         f"allowed {sorted(str(d) for d in (*_TYPES, *SIXTEEN_BIT))}")
    if t.device.type == "cpu":
        # The raw address, not t.numpy(): numpy() marks the storage non-resizable for good, and ZeRO-3 frees
        # gathered parameters by resizing their storage to zero.
        return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), datatype]
    if t.device.type == "cuda":
        if not cuda_aware:
            raise CommError(
                f"{what} on rank {rank}: got a CUDA tensor, but this MPI library "
                f"({MPI.Get_library_version().splitlines()[0].strip()}) is not CUDA-aware. Use backend='nccl' for "
                "GPU tensors (shardwise.init(backend='nccl') works under mpirun and srun), or a CUDA-aware MPI "
                "build (SHARDWISE_MPI_CUDA_AWARE=1 forces this path)",
                op=what.split("(")[0], rank=rank,
            )
        torch.cuda.current_stream(t.device).synchronize()  # MPI does not wait for queued kernels
        flat = t.detach().reshape(-1)
        return [flat.view(torch.int16) if t.dtype in SIXTEEN_BIT else flat, datatype]  # via __dlpack__
    raise ValueError(f"{what}: tensors on {t.device} are not supported by the mpi backend (cpu or cuda)")


def mpi_reduction(name: str, op: ReduceOp, t: torch.Tensor) -> Any:
    """The MPI operation for `op` on `t`'s dtype (AVG is SUM, divided by `finisher`); ValueError where undefined."""
    op = check_reduce_op(name, op, t)
    if t.dtype == torch.bool:
        if op is ReduceOp.AVG:
            raise ValueError(f"{name}: op=AVG needs a floating-point tensor, got {t.dtype}; use SUM")
        return _BOOL_OPS[op]
    if t.is_complex() and op in (ReduceOp.MAX, ReduceOp.MIN):
        raise ValueError(f"{name}: op={op.name} is undefined for complex tensors; use SUM or AVG")
    return _OPS[op]


def finisher(target: torch.Tensor, staged: torch.Tensor, divide: int) -> Callable[[], None] | None:
    """The step that completes an operation staged in another tensor: divide (AVG) and copy back when needed."""
    same = staged.data_ptr() == target.data_ptr() and staged.dtype == target.dtype
    if same and divide == 1:
        return None

    def then() -> None:
        if divide != 1:
            staged.div_(divide)
        if not same:
            with torch.no_grad():
                target.copy_(staged.view(target.shape))

    return then
