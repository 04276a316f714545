#!/usr/bin/env python3
"""Checks the index arithmetic of `src/moetide/compute/csrc/lo_mma_pipelined.cu` without a GPU: its
formulas, restated here, for every instantiation (bits, matrices, token tiles, warps along K x N, main
loop, one pair per block or sorted blocks, token tiles in use) at the K of the tests and of OLMoE.

For each configuration: a stage's code copies cover every (K part, matrix, row, half) chunk exactly
once and its activation copies every (part, staged row, chunk) chunk of the staged rows exactly once,
all inside the stage; every lane's code read finds the two words lo_mma.cu loads from global memory
(rows g and g + 8, words 2t and 2t + 1 of its part's group), and every activation read the chunk of
the token row it wants, never an unstaged row; the 16-byte activation reads of each 8-lane phase fall
in 8 distinct bank groups. Edit this file with the kernel.

    python scripts/check_lo_pipeline_layout.py
"""

from __future__ import annotations

import itertools


def act_chunk(bits: int, q: int, row: int) -> int:
    """`act_chunk<BITS>(q, row)`: where chunk q of a staged activation row lies among its chunks."""
    return q ^ (row & 1) ^ (((q >> 2) & 2) if bits == 2 else 0)


def check(bits: int, nm: int, nt: int, wk_n: int, wn_n: int, one_pair: bool, nt_used: int, tokens_as_rows: bool,
          k: int) -> None:  # fmt: skip
    """One configuration (the kernel's BITS, NM, NT, WK, WN, ...); AssertionError on a broken invariant."""
    threads, rows_per_program, act_chunks = 32 * wk_n * wn_n, 16 * wn_n, 32 // bits
    group = 256 // bits
    per_part = k // group // wk_n
    act_rows = 1 if one_pair else 8 * nt
    staged = 1 if one_pair else 8 * nt_used
    if tokens_as_rows:
        staged = min(act_rows, (staged + 15) & ~15)
    code_bytes = wk_n * nm * rows_per_program * 32
    act_copies = (8 * nt * act_chunks + 32 * wn_n - 1) // (32 * wn_n)
    stage_bytes = code_bytes + wk_n * act_rows * act_chunks * 16

    code = {}  # stage offset -> (matrix, row, first group of the part, half)
    for tid in range(threads):
        for i in range(nm):
            c = tid + i * threads
            half, r = c & 1, (c >> 1) % rows_per_program
            m, part = (c >> 1) // rows_per_program % nm, (c >> 1) // rows_per_program // nm
            dst = ((part * nm + m) * rows_per_program + r) * 32 + half * 16
            assert dst not in code
            code[dst] = (m, r, part * per_part, half)
    assert len(code) == wk_n * nm * rows_per_program * 2
    acts = {}  # stage offset -> (row, element of the row at stage 0)
    for tid in range(threads):
        for i in range(act_copies):
            c = tid + i * threads
            if c >= wk_n * staged * act_chunks:
                continue
            q, row, part = c % act_chunks, c // act_chunks % staged, c // act_chunks // staged
            dst = code_bytes + ((part * act_rows + row) * act_chunks + act_chunk(bits, q, row)) * 16
            assert dst not in acts
            acts[dst] = (row, part * per_part * group + q * 8)
    assert len(acts) == wk_n * staged * act_chunks
    assert max([*code, *acts]) + 16 <= stage_bytes

    loads = (32 // bits) // 4  # 16-byte activation loads of a lane per group and token row
    for warp, lane in itertools.product(range(wk_n * wn_n), range(32)):
        wk, wn, g, t = warp % wk_n, warp // wk_n, lane >> 2, lane & 3
        for m, h in itertools.product(range(nm), range(2)):
            off = ((wk * nm + m) * rows_per_program + 16 * wn + g + 8 * h) * 32 + 8 * t
            src = code[off & ~15]
            assert src[:3] == (m, 16 * wn + g + 8 * h, wk * per_part) and src[3] * 16 + (off & 15) == 8 * t
        if tokens_as_rows:
            rows = [r for jj in range(nt // 2) if 2 * jj < nt_used for r in (16 * jj + g, 16 * jj + 8 + g)]
        else:
            rows = [8 * j + g if 8 * j + g < staged else 0 for j in range(nt) if j < nt_used]
        for row, i in itertools.product(rows, range(loads)):
            assert row < staged, "a read of an unstaged row"
            q = loads * t + i
            off = code_bytes + ((wk * act_rows + row) * act_chunks + act_chunk(bits, q, row)) * 16
            assert acts[off] == (row, wk * per_part * group + q * 8)

    for lane0, i, j in itertools.product(range(0, 32, 8), range(loads), range(nt)):
        places = set()
        for lane in range(lane0, lane0 + 8):
            g, t = lane >> 2, lane & 3
            row = 8 * j + g if 8 * j + g < staged else 0
            places.add(row * act_chunks + act_chunk(bits, loads * t + i, row))
        assert len({p % 8 for p in places}) == len(places), ("bank conflict", bits, lane0, i)


def main() -> int:
    n = 0
    warps = ((1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2))  # (along K, along N), as `by_warps`
    for bits, nm, nt, (wk, wn), k in itertools.product((2, 4), (1, 2), (1, 2, 4), warps, (128, 256, 1024, 2048)):
        if (k // (256 // bits)) % wk or wk * wn == 8 and nt == 1:  # 8 warps: blocks of 16 or more rows
            continue  # `lo_cuda.warps_along_k` takes a divisor of the row's groups
        for one_pair in (True, False) if nt == 1 else (False,):
            for tokens_as_rows in (False, True) if nt > 1 else (False,):
                for nt_used in range(1, nt + 1):
                    check(bits, nm, nt, wk, wn, one_pair, nt_used, tokens_as_rows, k)
                    n += 1
    print(f"ok: {n} configurations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
