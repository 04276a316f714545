"""Compile one fused MoE kernel ahead of time for sm_90 (no GPU needed) and count its SASS
instructions by opcode: what a tile product costs per K-tile, before timing it on the H200.

    python scripts/sass_histogram.py --kernel gate_up --bits 4 --group 64 --tiles 32,128,64,4,3 \
        --packed-tile v2 v3 [--top 12]

--tiles: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages (the tile table's entry). The shape is
OLMoE's (H 2048, I 1024, top-8), bf16 activations. Uses the nvdisasm that ships with Triton.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moetide.compute import fused_moe as fm

HIDDEN, INTER, TOP_K = 2048, 1024, 8
OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)")


def compile_kernel(kernel: str, bits: int, group: int, tiles: list[int], packed: str, wait_pool: int = -1) -> bytes:
    block_m, block_n, block_k, warps, stages = tiles
    jit = fm._gate_up_kernel if kernel == "gate_up" else fm._down_kernel
    if kernel == "gate_up":
        sig = {"x_ptr": "*bf16", "stride_x": "i32", "h_ptr": "*bf16"}
        const = {"TOP_K": TOP_K, "HIDDEN": HIDDEN, "INTER": INTER}
    else:
        sig = {"h_ptr": "*bf16", "y_ptr": "*fp32", "routing_ptr": "*fp32"}
        const = {"HIDDEN": HIDDEN, "INTER": INTER}
    sig.update({name: "*i32" for name in ("sorted_pair_ptr", "block_expert_ptr", "pool_of_ptr", "slot_of_ptr",
                                          "wait_ptr", "landed_ptr")})  # fmt: skip
    sig.update({name: "i32" for name in ("slot_stride", "num_pairs", "POOL_ID", "row_data", "row_param",
                                         "data_off", "scale_off", "offset_off")})  # fmt: skip
    words = packed in ("v6", "v7") and block_m == 1 or fm.PACKED_TILES[packed] >= 5 and block_m > 1
    sig.update(data_ptr="*i32" if words else "*u8", param_ptr="*fp16")  # v4..v7 read the arena as int32 words
    sub_k = block_k if packed == "v7" and block_m == 1 else min(block_k, group)  # v7: one product per K-step
    const.update(BITS=bits, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=sub_k,
                 PACKED=fm.PACKED_TILES[packed], DOT_PRECISION="tf32", WAIT=wait_pool, ONE_PAIR=block_m == 1,
                 USE_GDC=False)  # fmt: skip
    sig.update({name: "constexpr" for name in const})
    sig = {a: sig[a] for a in jit.arg_names}
    aligned = [i for i, a in enumerate(jit.arg_names)
               if sig[a] != "constexpr" and a not in ("num_pairs", "POOL_ID", "slot_stride")]  # fmt: skip
    src = ASTSource(jit, sig, constexprs={(jit.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["cubin"]


def histogram(cubin: bytes) -> collections.Counter:
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return collections.Counter(m.group(1) for line in sass.splitlines() if (m := OPCODE.match(line)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("gate_up", "down"), default="gate_up")
    ap.add_argument("--bits", type=int, choices=(2, 4), default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--tiles", default="32,128,64,4,3")
    ap.add_argument("--packed-tile", nargs="+", default=["v2", "v3"], choices=sorted(fm.PACKED_TILES))
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--wait-pool", type=int, default=-1, help="compile the wait for copies in flight (a pool id)")
    args = ap.parse_args()
    tiles = [int(x) for x in args.tiles.split(",")]
    for packed in args.packed_tile:
        counts = histogram(compile_kernel(args.kernel, args.bits, args.group, tiles, packed, args.wait_pool))
        top = "  ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
        print(f"{args.kernel} int{args.bits} g{args.group} tiles {args.tiles} {packed}: {sum(counts.values())} instructions"
              f" (I2F {counts['I2F']})  {top}")  # fmt: skip


if __name__ == "__main__":
    main()
