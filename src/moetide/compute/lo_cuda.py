"""The lo pool's projections on tensor cores (`csrc/lo_mma.cu`, with its shared parts in
`csrc/lo_mma_common.cuh`), built once with nvcc, called by ctypes.

`fused_moe` sends a packed pool's gate_up and down launches here (`eligible`) instead of to its
Triton tiles: an int2 pool at every T, an int4 one (or one with an int4 matrix) for T <= MAX_TOKENS
(decode batches) and T > TILES_MAX_TOKENS (prefill chunks); on blocks of at most WIDE_BLOCK_M rows,
the same sorted blocks, scratch h and per-pair y, so the reduce and every other pool are unchanged
(a pool on its one-launch slices beside it included: the CUDA pool's sums fill slice 0 of its pairs'
rows). From TOKENS_AS_ROWS_FROM tokens on, blocks of 16 or 32 rows take the kernel's other main loop
(the tokens as the MMA's rows, `tokens_as_rows` in the source). The kernel reads the arena rows as
they are; why that can use tensor cores is in the source's header. On sm_90 down runs as a
programmatic dependent of gate_up and the reduce as one of down (`dependent_launches`).

Built on first use for the device's architecture into ~/.cache/moetide/kernels (`cache_dir`), under a
name that hashes the source, the architecture and nvcc's version; a build takes ~20 s and says so on
stderr. Programs are 4 warps (`warp_grid`). Off (the Triton tiles everywhere) where there is no CUDA
device of sm_80 or newer, no nvcc (PATH, CUDA_HOME), or `--lo-kernel triton` (`fused_moe`'s
`cuda_kernels`); a failed build is reported once, in one line, and leaves the Triton path on.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from ..residency.slot_table import MatrixFormat, Pool

SOURCE = Path(__file__).with_name("csrc") / "lo_mma.cu"
MAX_TOKENS = 32  # up to this many tokens the kernels take an int4 pool, and above TILES_MAX_TOKENS; between,
TILES_MAX_TOKENS = 128  # the Triton dot tiles (faster there for int4)
GROUP_BITS = 256  # a group of a row is 8 int32 words (int2 in groups of 128, int4 in groups of 64)
BLOCK_MS = (1, 8, 16, 32)  # sorted block sizes the kernel takes (8 * its n8 tiles)
WIDE_BLOCK_M = 32  # the layer's blocks where the table's tiles have more rows than the kernel takes
TOKENS_AS_ROWS_FROM = 129  # from this many tokens, blocks of 16 / 32 rows run the tokens as MMA rows
ROUTING_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class LoArgs(ctypes.Structure):
    """`LoArgs` of lo_mma.cu, field for field."""

    _fields_ = [
        ("act", ctypes.c_void_p),
        ("act_stride", ctypes.c_longlong),
        ("out", ctypes.c_void_p),
        ("out_stride", ctypes.c_longlong),
        ("routing", ctypes.c_void_p),
        ("sorted_pair", ctypes.c_void_p),
        ("block_expert", ctypes.c_void_p),
        ("pool_of", ctypes.c_void_p),
        ("slot_of", ctypes.c_void_p),
        ("slot_stride", ctypes.c_longlong),
        ("wait_of", ctypes.c_void_p),
        ("landed", ctypes.c_void_p),
        ("arena", ctypes.c_void_p),
        ("row_bytes", ctypes.c_longlong),
        ("data_off", ctypes.c_longlong),
        ("scale_off", ctypes.c_longlong),
        ("offset_off", ctypes.c_longlong),
        ("num_pairs", ctypes.c_int),
        ("pool_id", ctypes.c_int),
        ("K", ctypes.c_int),
        ("N", ctypes.c_int),
        ("group", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("block_m", ctypes.c_int),
        ("one_pair", ctypes.c_int),
        ("experts_i64", ctypes.c_int),
        ("routing_dtype", ctypes.c_int),
    ]


def dependent_launches(device: torch.device) -> bool:
    """Whether down runs as a programmatic dependent of gate_up (its rows found and their loads started
    while gate_up finishes), and the layer's reduce as one of down: sm_90 or newer."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    """Where built kernels are kept: ~/.cache/moetide/kernels."""
    return Path.home() / ".cache" / "moetide" / "kernels"


def source_text(src: Path) -> str:
    """`src` with the text of each header it includes from its own directory (`#include "..."`, e.g.
    lo_mma_common.cuh) after it: what a build compiles, and so what its cache name hashes."""
    text = src.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, re.MULTILINE)
    return text + "".join((src.parent / name).read_text() for name in headers)


def build(arch: str, compiler: str, out_dir: Path, src: Path = SOURCE) -> Path:
    """`src` (lo_mma.cu) as a shared library for `arch` ("90": sm_90) in `out_dir`: `(path)`, built unless
    there. RuntimeError (one line: nvcc's last line) if the build fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256((source_text(src) + arch + version).encode()).hexdigest()[:16]
    target = out_dir / f"lo_mma_sm{arch}_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"moetide: building the low-bit CUDA kernels for sm_{arch} (once, ~20 s) ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "--cudart", "static",
               f"-gencode=arch=compute_{arch},code=sm_{arch}", str(src), "-o", str(built)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise RuntimeError(f"nvcc could not build {src.name} for sm_{arch}: {lines[-1]}")
        os.replace(built, target)  # atomic: another process may build the same file
    return target


@lru_cache(maxsize=8)
def library(device_index: int):
    """The loaded library of SOURCE for one CUDA device, or None (no nvcc, an old GPU, a failed build)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    compiler = nvcc()
    if major < 8 or compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(build(f"{major}{minor}", compiler, cache_dir(), SOURCE)))
    except (RuntimeError, OSError) as error:
        return _off(error)
    lib.moetide_lo_mma.restype = ctypes.c_int
    lib.moetide_lo_mma.argtypes = ENTRY_ARGTYPES
    lib.moetide_lo_error.restype = ctypes.c_char_p
    lib.moetide_lo_error.argtypes = [ctypes.c_int]
    return lib


def _off(reason) -> None:
    """Says in one line on stderr why the kernels are off (the Triton tiles run): `library`'s None."""
    print(f"moetide: low-bit CUDA kernels off, the Triton tiles run instead: {reason}", file=sys.stderr)


# moetide_lo_mma(args, matrices, bits, nt, wk, wn, blocks, dependent, tokens_as_rows, stream)
ENTRY_ARGTYPES = [ctypes.POINTER(LoArgs)] + [ctypes.c_int] * 8 + [ctypes.c_void_p]


def _fits(matrix: MatrixFormat, k: int, n: int, row_bytes: int) -> bool:
    """Whether the kernels take this matrix: int2 / int4 in groups of 256 bits, n a multiple of a
    program's 64 rows, codes, scales and offsets copied in 16-byte pieces (aligned)."""
    return (matrix.bits in (2, 4) and matrix.group_size * matrix.bits == GROUP_BITS and k % matrix.group_size == 0
            and n % 64 == 0 and matrix.data_offset % 16 == 0 and row_bytes % 16 == 0
            and matrix.scale_offset % 8 == 0 and matrix.offset_offset % 8 == 0)  # fmt: skip


def eligible(pool: Pool, hidden: torch.Tensor, block_m: int, routing_dtype: torch.dtype) -> bool:
    """Whether this pool's launches go to the CUDA kernels: both matrices packed int2 / int4 in groups
    of 256 bits (the default groups: 128 and 64 codes), rows aligned to 16 bytes, bf16 activations on a CUDA
    device with the library built, a T the kernels take (`takes_tokens`), sorted blocks of at most 32 rows."""
    f = pool.format
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and block_m in BLOCK_MS):
        return False
    if routing_dtype not in ROUTING_DTYPES:
        return False
    if not (f.gate_up.packed and f.down.packed):
        return False
    if not takes_tokens(hidden.shape[0], max(f.gate_up.bits, f.down.bits)):
        return False
    row_bytes = pool.arena.shape[1]
    if not (_fits(f.gate_up, f.hidden_size, f.intermediate_size, row_bytes)
            and _fits(f.down, f.intermediate_size, f.hidden_size, row_bytes)):  # fmt: skip
        return False
    return library(hidden.device.index) is not None


def takes_tokens(num_tokens: int, bits: int) -> bool:
    """Whether a layer of `num_tokens` tokens runs its lo pool here, `bits` its widest matrix's: int2 at
    every T; int4 for decode batches up to MAX_TOKENS and above TILES_MAX_TOKENS (prefill chunks),
    the Triton tiles between (faster there)."""
    return bits == 2 or num_tokens <= MAX_TOKENS or num_tokens > TILES_MAX_TOKENS


def warps_along_k(num_tokens: int, groups: int, bits: int) -> int:
    """Warps of a program that split K (the others split N): 4 for int4 up to MAX_TOKENS tokens and for
    int2 up to 4 tokens, 2 above; from TOKENS_AS_ROWS_FROM tokens on (the tokens as the MMA's rows) 1,
    int4 below 512 tokens 2 (the fastest of 1, 2, 4 per cell as measured); a divisor of the row's
    `groups`."""
    if num_tokens >= TOKENS_AS_ROWS_FROM:
        wk = 2 if bits == 4 and num_tokens < 512 else 1
    else:
        wk = 4 if num_tokens <= 4 or bits == 4 and num_tokens <= MAX_TOKENS else 2
    while groups % wk:
        wk //= 2
    return wk


def warp_grid(num_tokens: int, matrix: MatrixFormat, k: int, n: int, block_m: int) -> tuple[int, int]:
    """(warps along K, warps along N) of a launch's programs of 4 warps: `warps_along_k`'s wk, and
    4 / wk along N (16 * 4 / wk rows of each matrix per program)."""
    wk = warps_along_k(num_tokens, k // matrix.group_size, matrix.bits)
    return wk, 4 // wk


def tokens_as_rows(num_tokens: int, block_m: int) -> bool:
    """Whether blocks of `block_m` rows of a `num_tokens`-token layer run the main loop that makes 16
    tokens the MMA's rows and the weight rows its columns (blocks of 16 or 32 rows, from
    TOKENS_AS_ROWS_FROM tokens on): one unpack of a group's codes per 16 tokens instead of per 8."""
    return block_m in (16, 32) and num_tokens >= TOKENS_AS_ROWS_FROM


def launch(pool: Pool, pool_id: int, matrix: MatrixFormat, *, act: torch.Tensor, out: torch.Tensor,
           k: int, n: int, blocks: int, block_m: int, one_pair: bool, sorted_pair: torch.Tensor,
           block_expert: torch.Tensor, pool_of: torch.Tensor, slot_of: torch.Tensor, num_pairs: int,
           top_k: int, num_tokens: int, routing: torch.Tensor | None = None,
           waits: tuple[torch.Tensor, torch.Tensor] | None = None, dependent: bool = False) -> None:  # fmt: skip
    """One launch over `pool`'s blocks for gate_up (`matrix` is its gate_up: n = I, writes h in act's
    dtype) or down (`routing` given: n = H, writes y float32 per pair; `dependent`: a programmatic
    dependent launch of the gate_up launch just before it, `dependent_launches`), on the current stream;
    the tokens as the MMA's rows where `tokens_as_rows`."""
    lib = library(act.device.index)
    arena = pool.arena
    args = LoArgs(
        act=act.data_ptr(), act_stride=act.stride(0), out=out.data_ptr(), out_stride=out.stride(0),
        routing=routing.data_ptr() if routing is not None else None, sorted_pair=sorted_pair.data_ptr(),
        block_expert=block_expert.data_ptr(), pool_of=pool_of.data_ptr(), slot_of=slot_of.data_ptr(),
        slot_stride=slot_of.shape[-1] if slot_of.dim() == 2 else 0,
        wait_of=waits[0].data_ptr() if waits is not None else None,
        landed=waits[1].data_ptr() if waits is not None else None,
        arena=arena.data_ptr(), row_bytes=arena.stride(0), data_off=matrix.data_offset,
        scale_off=matrix.scale_offset, offset_off=matrix.offset_offset,
        num_pairs=num_pairs, pool_id=pool_id, K=k, N=n, group=matrix.group_size, top_k=top_k,
        block_m=block_m, one_pair=int(one_pair), experts_i64=int(block_expert.dtype == torch.int64),
        routing_dtype=ROUTING_DTYPES[routing.dtype] if routing is not None else 0,
    )  # fmt: skip
    nt = max(1, block_m // 8)
    wk, wn = warp_grid(num_tokens, matrix, k, n, block_m)
    stream = torch.cuda.current_stream(act.device).cuda_stream
    matrices, rows = 1 if routing is not None else 2, int(tokens_as_rows(num_tokens, block_m))
    code = lib.moetide_lo_mma(ctypes.byref(args), matrices, matrix.bits, nt, wk, wn, blocks, int(dependent),
                              rows, stream)  # fmt: skip
    if code != 0:
        raise RuntimeError(f"lo_mma launch failed: {lib.moetide_lo_error(code).decode()}")
