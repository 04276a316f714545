"""scripts/lo_sass.py without a GPU: the scheduling controls read from real ptxas output (sm_90,
lo_mma.cu's int2 gate_up kernel), the main loop found, and a wait traced to the load that set its
scoreboard, in the same iteration or the one before (no compiler needed); with nvcc, an instantiation
the dispatch never builds refused in one line."""

from __future__ import annotations

import shutil

import pytest
from script_module import load_script

lo_sass = load_script("lo_sass")

# three instructions of lo_mma_kernel<2, 2, 2, 2, 2, false> as cuobjdump printed them (nvcc 13.0, sm_90;
# runs of spaces shortened)
REAL = """
    /*1ca0*/    LDG.E.64.CONSTANT R68, desc[UR6][R68.64] ;    /* 0x0000000644447981 */
    /* 0x000f64000c1e9b00 */
    /*1d80*/    LDG.E.128 R32, desc[UR6][R48.64+0x10] ;    /* 0x0000100630207981 */
    /* 0x000ea8000c1e1d00 */
    /*1dc0*/    SHF.R.U32.HI R46, RZ, 0x2, R14 ;    /* 0x00000002ff2e7819 */
    /* 0x020fe2000001160e */
"""


def line(addr: int, text: str, wb: int = 7, rb: int = 7, wait: int = 0, stall: int = 1) -> str:
    """One instruction in cuobjdump's layout with these controls (the low word's bits are not read)."""
    ctrl = stall | wb << 5 | rb << 8 | wait << 11
    return (f"        /*{addr:04x}*/                   {text} ;   /* 0x{0:016x} */\n"
            f"                                              /* 0x{ctrl << 41:016x} */\n")  # fmt: skip


def test_the_controls_of_real_ptxas_output_decode_as_scoreboards():
    words, acts, shift = lo_sass.parse(REAL)
    assert (words.opcode, words.write_barrier, words.wait_mask) == ("LDG.E.64.CONSTANT", 5, 0)
    assert (acts.opcode, acts.write_barrier) == ("LDG.E.128", 2)
    assert shift.write_barrier == lo_sass.NO_BARRIER and shift.waits_on() == [5]  # the words' scoreboard


def _loop(first_use_waits: bool) -> list:
    """A group loop: the next group's words loaded on SB5, this group's activations on SB2, an HMMA."""
    text = line(0x00, "LDG.E.64.CONSTANT R14, desc[UR6][R14.64]", wb=5)  # the first group, before the loop
    text += line(0x10, "LDG.E.64.CONSTANT R22, desc[UR6][R36.64]", wb=5)  # loop head: the next group's words
    text += line(0x20, "LDG.E.128 R28, desc[UR6][R48.64]", wb=2)
    text += line(0x30, "SHF.R.U32.HI R46, RZ, 0x2, R14", wait=0b100000 if first_use_waits else 0)
    text += line(0x40, "PRMT R56, R28, 0x5410, R32", wait=0b000100)
    text += line(0x50, "HMMA.16816.F32.BF16 R44, R44, R56, RZ")
    text += line(0x60, "IMAD.MOV.U32 R14, RZ, RZ, R22", wait=0b100000)
    text += line(0x70, "@!P0 BRA 0x10")
    return lo_sass.parse(text)


def test_the_main_loop_is_the_backward_branch_around_the_hmmas():
    instrs = _loop(True)
    assert lo_sass.loops(instrs) == [(1, 7)]
    assert lo_sass.main_loop(instrs) == (1, 7)
    assert lo_sass.main_loop(instrs[:5] + instrs[6:]) is None  # no HMMA, no main loop


def test_a_wait_names_the_load_that_last_set_its_scoreboard():
    found = lo_sass.waits_in_loop(*_two(True))
    waits = {(ins.addr, sb): (setter.addr, same) for ins, sb, setter, same in found}
    # the group's first use waits on SB5, last set by the next group's load of this same iteration
    assert waits[(0x30, 5)] == (0x10, True)
    assert waits[(0x40, 2)] == (0x20, True)
    assert waits[(0x60, 5)] == (0x10, True)
    report = lo_sass.report(_loop(True))
    assert "SHF.R.U32.HI R46" in report and "(this iteration)" in report
    assert "SHF.R.U32.HI R46" not in lo_sass.report(_loop(False))


def test_a_wait_before_the_iterations_load_names_the_iteration_before():
    instrs = lo_sass.parse(line(0x00, "SHF.R.U32.HI R46, RZ, 0x2, R14", wait=0b100000)
                           + line(0x10, "HMMA.16816.F32.BF16 R44, R44, R56, RZ")
                           + line(0x20, "LDG.E.64.CONSTANT R14, desc[UR6][R36.64]", wb=5)
                           + line(0x30, "BRA 0x0"))  # fmt: skip
    [(ins, sb, setter, same)] = lo_sass.waits_in_loop(instrs, lo_sass.main_loop(instrs))
    assert (ins.addr, sb, setter.addr, same) == (0x00, 5, 0x20, False)


def _two(first_use_waits: bool):
    instrs = _loop(first_use_waits)
    return instrs, lo_sass.main_loop(instrs)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_an_instantiation_the_dispatch_does_not_build_is_a_one_line_error():
    with pytest.raises(SystemExit, match="is not in lo_mma.cu"):
        lo_sass.function_sass(lo_sass.SOURCE, lo_sass.mangled(2, 2, 8, 2, 2, False))
