#!/usr/bin/env python3
"""The SASS of one instantiation of the lo kernels (`csrc/lo_mma.cu`, or another source with its
lo_mma_common.cuh beside it), compiled for sm_90 on any machine with nvcc (no GPU needed), and what
each instruction of its main loop waits on.

    python scripts/lo_sass.py --bits 2 --matrices 2 --nt 2 --warps 2x2 [--tokens-as-rows] \\
        [--source var/lo_x.cu] [--listing]

An sm_90 instruction is 128 bits; the top bits of its second word are the scheduling controls ptxas
sets: a variable-latency instruction (a load, a shared-memory access, MUFU ...) sets one of six
scoreboards when its result lands (`wb`) or its operands have been read (`rb`), and an instruction
that needs such a result first waits until every operation counted on the scoreboards of its wait mask
has finished. So an instruction that waits on a scoreboard also waits for every later load that shares
it: with a load for the next group issued on the same scoreboard as the current group's, the current
group's first use waits for the next group's load too, and the prefetch hides nothing. This script
finds the main loop (the backward branch around the most HMMAs) and, for every instruction in it with
a wait mask, names the loads that last set each scoreboard it waits on, in this iteration or the one
before. The disassembler is the cuobjdump that ships with Triton (or one on PATH).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "moetide" / "compute" / "csrc" / "lo_mma.cu"
LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* 0x([0-9a-f]{16}) \*/")
HEX = re.compile(r"/\* 0x([0-9a-f]{16}) \*/")
NO_BARRIER = 7


@dataclass(frozen=True)
class Instr:
    """One SASS instruction: its address, text and scheduling controls (bits 105.. of the 128)."""

    addr: int
    text: str
    stall: int  # cycles before the next instruction may issue
    write_barrier: int  # scoreboard set when the result lands (NO_BARRIER: none)
    read_barrier: int  # scoreboard set when the operands have been read (NO_BARRIER: none)
    wait_mask: int  # scoreboards waited on before issue (bit k: scoreboard k)

    @property
    def opcode(self) -> str:
        return re.sub(r"^@!?U?P[0-9T]\s+", "", self.text).split()[0]

    def waits_on(self) -> list[int]:
        return [k for k in range(6) if self.wait_mask >> k & 1]


def controls(high_word: int) -> tuple[int, int, int, int]:
    """(stall, write barrier, read barrier, wait mask) from an instruction's second 64-bit word."""
    c = high_word >> 41
    return c & 0xF, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F


def parse(sass: str) -> list[Instr]:
    """The instructions of a cuobjdump / nvdisasm listing of one function (each instruction's two hex
    words on its own line and the next)."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = LINE.match(line)
        if not m or i + 1 >= len(lines):
            continue
        high = HEX.search(lines[i + 1])
        if high is None:
            continue
        stall, wb, rb, mask = controls(int(high.group(1), 16))
        out.append(Instr(int(m.group(1), 16), m.group(2).strip(), stall, wb, rb, mask))
    return out


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) index of each loop: a branch back to an address at or before it."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    found = []
    for i, ins in enumerate(instrs):
        m = re.search(r"\bBRA\s+(?:\S+,\s*)?(0x[0-9a-f]+)", ins.text)
        if m and (target := int(m.group(1), 16)) <= ins.addr and target in index:
            found.append((index[target], i))
    return found


def main_loop(instrs: list[Instr]) -> tuple[int, int] | None:
    """The loop with the most HMMAs in it (the innermost such, on a tie)."""
    scored = [(sum(ins.opcode.startswith("HMMA") for ins in instrs[a : b + 1]), -(b - a), (a, b))
              for a, b in loops(instrs)]  # fmt: skip
    scored = [s for s in scored if s[0] > 0]
    return max(scored)[2] if scored else None


def waits_in_loop(instrs: list[Instr], loop: tuple[int, int]) -> list[tuple[Instr, int, Instr, bool]]:
    """For each instruction of the loop with a wait mask: (it, scoreboard, the instruction whose result
    last set that scoreboard before it in loop order, whether that one is in the same iteration). Scanning
    back from the instruction to the loop's head, then on from the loop's end (the iteration before).
    Scoreboards set when operands have been read (a register about to be overwritten) are left out."""
    first, last = loop
    body = instrs[first : last + 1]
    out = []
    for k, ins in enumerate(body):
        for sb in ins.waits_on():
            order = [(j, True) for j in range(k - 1, -1, -1)]
            order += [(j, False) for j in range(len(body) - 1, k, -1)]  # the iteration before
            setter = next(((body[j], same) for j, same in order if body[j].write_barrier == sb), None)
            if setter is not None:
                out.append((ins, sb, setter[0], setter[1]))
    return out


def mangled(bits: int, matrices: int, nt: int, wk: int, wn: int, tokens_as_rows: bool) -> str:
    return f"_Z13lo_mma_kernelILi{bits}ELi{matrices}ELi{nt}ELi{wk}ELi{wn}ELb{int(tokens_as_rows)}EEv6LoArgs"


def cuobjdump() -> str:
    """Triton's cuobjdump (beside the nvdisasm `sass_histogram.py` uses), else one on PATH."""
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found is None:
        raise SystemExit("lo_sass: no cuobjdump (Triton's or on PATH)")
    return found


def function_sass(source: Path, name: str) -> str:
    """`name`'s SASS from `source` compiled to an sm_90 cubin with nvcc (SystemExit, one line, if that
    fails)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("lo_sass: no nvcc on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "lo.cubin"
        cmd = [nvcc, "-O3", "-std=c++17", "-cubin", "-gencode=arch=compute_90,code=sm_90", str(source),
               "-o", str(cubin)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"lo_sass: nvcc failed: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
        dump = [cuobjdump(), "-sass", "-fun", name, str(cubin)]
        sass = subprocess.run(dump, capture_output=True, text=True, check=False).stdout
    if "Function :" not in sass:
        raise SystemExit(f"lo_sass: {name} is not in {source.name} (the dispatch never builds it)")
    return sass


def report(instrs: list[Instr], listing: bool = False) -> str:
    lines = []
    loop = main_loop(instrs)
    if loop is None:
        return "no loop with an HMMA in it"
    first, last = loop
    body = instrs[first : last + 1]
    lines.append(f"main loop: {instrs[first].addr:#06x} .. {instrs[last].addr:#06x}, "
                 f"{len(body)} instructions")
    counts = collections.Counter(ins.opcode.split(".")[0] for ins in body)
    lines.append("  opcodes: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(14)))
    lines.append("  waits on a load's result:")
    for ins, sb, setter, same in waits_in_loop(instrs, loop):
        if setter.opcode.startswith(("LDG", "LDS", "LD.")):
            when = "this iteration" if same else "the iteration before"
            lines.append(f"    {ins.addr:#06x} {ins.text[:44]:44s} SB{sb} <- {setter.addr:#06x} "
                         f"{setter.text[:40]} ({when})")  # fmt: skip
    if listing:
        lines.append("  listing:")
        for ins in body:
            wb = "-" if ins.write_barrier == NO_BARRIER else ins.write_barrier
            lines.append(f"    {ins.addr:#06x} st{ins.stall:<2d} wb{wb} wait{ins.wait_mask:06b}  {ins.text}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--bits", type=int, choices=(2, 4), default=2)
    ap.add_argument("--matrices", type=int, choices=(1, 2), default=2, help="2: gate_up, 1: down")
    ap.add_argument("--nt", type=int, choices=(1, 2, 4), default=2, help="n8 token tiles")
    ap.add_argument("--warps", default="2x2", help="warps along K x along N")
    ap.add_argument("--tokens-as-rows", action="store_true")
    ap.add_argument("--listing", action="store_true", help="also print the main loop with its controls")
    args = ap.parse_args()
    wk, wn = (int(v) for v in args.warps.split("x"))
    name = mangled(args.bits, args.matrices, args.nt, wk, wn, args.tokens_as_rows)
    print(name)
    print(report(parse(function_sass(args.source, name)), args.listing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
