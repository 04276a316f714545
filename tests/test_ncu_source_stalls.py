"""scripts/ncu_source_stalls.py on a small export in Nsight Compute's `--page source --csv` layout: the
stall shares of each kernel, its hottest instructions with their main reasons, a kernel listed twice
read once, and an export without the source counters refused in one line."""

from __future__ import annotations

import pytest
from script_module import load_script

stalls = load_script("ncu_source_stalls")

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
          '"stall_long_sb","stall_wait","stall_selected","stall_long_sb (Not Issued)"')


def export(name: str, rows: list[tuple[str, str, int, int, int, int, int]]) -> str:
    body = "\n".join(f'"{a}","{s}","{n}","0","{x}","{lsb}","{w}","{sel}","{lsb}"'
                     for a, s, n, x, lsb, w, sel in rows)
    return f'"Kernel Name","{name}",\n{HEADER}\n{body}\n'


GATE_UP = [("0x10", "  LDG.E.64 R14, desc[UR6][R14.64]", 10, 8, 0, 2, 8),
           ("0x20", "  SHF.R.U32.HI R46, RZ, 0x2, R14", 60, 8, 55, 1, 4),
           ("0x30", "  HMMA.16816.F32.BF16 R44, R44, R56, RZ", 30, 16, 0, 20, 10)]  # fmt: skip
DOWN = [("0x10", "  PRMT R44, R20, 0x5410, R16", 5, 4, 5, 0, 0)]


def test_each_kernel_s_shares_and_hottest_instructions():
    text = export("gate_up", GATE_UP) + export("gate_up", GATE_UP) + export("down", DOWN)
    gate_up, down = stalls.kernels(text, top=2)
    assert (gate_up.name, gate_up.samples, gate_up.executed) == ("gate_up", 100, 32)
    assert gate_up.reasons == pytest.approx({"long_sb": 0.55, "wait": 0.23, "selected": 0.22})
    assert list(gate_up.reasons) == ["long_sb", "wait", "selected"]  # largest first
    first, second = gate_up.top
    assert first[:4] == ("0x20", "SHF.R.U32.HI R46, RZ, 0x2, R14", 0.6, 8)
    assert first[4] == ["long_sb", "selected"]
    assert second[0] == "0x30" and second[4] == ["wait", "selected"]
    assert down.reasons["long_sb"] == 1.0 and down.top[0][2] == 1.0
    assert "60.0%" in stalls.render([gate_up]) and "long_sb 55.0%" in stalls.render([gate_up])


def test_an_export_without_the_source_counters_is_refused():
    with pytest.raises(ValueError, match="SourceCounters"):
        stalls.kernels('"Kernel Name","k",\n"Address","Source","Instructions Executed"\n"0x10","NOP","1"\n')
