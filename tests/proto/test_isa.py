"""Sequencer instruction encoding: one table, round trips, typed errors."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpgaccl.errors import MalformedHeaderError
from fpgaccl.proto.isa import INSTRUCTION, Buf, Instr, SeqOp, assemble, chunk_size, disassemble
from fpgaccl.proto.programs import LIBRARY

instrs = st.builds(Instr, op=st.sampled_from(list(SeqOp)), buf=st.sampled_from(list(Buf)),
                   src=st.sampled_from(list(Buf)), rbuf=st.sampled_from(list(Buf)),
                   peer=st.integers(0, 255), chunk=st.integers(0, 255),
                   count=st.integers(0, 255), xchunk=st.integers(0, 255),
                   step=st.integers(0, 0xFFFF))


@given(st.lists(instrs, max_size=20))
def test_assemble_disassemble_round_trip(program):
    words = assemble(program)
    assert len(words) == 2 * len(program) and all(0 <= w < 1 << 32 for w in words)
    assert disassemble(words) == program


def test_instruction_is_64_bits_with_op_in_the_top_nibble():
    assert INSTRUCTION.bits == 64
    assert Instr(SeqOp.DONE).encode() >> 60 == SeqOp.DONE


def test_unknown_op_names_the_field():
    with pytest.raises(MalformedHeaderError) as e:
        disassemble([0, 0xE << 28])
    assert e.value.field == "op"


def test_chunk_geometry():
    assert chunk_size(10, 4) == 3 and chunk_size(8, 4) == 2 and chunk_size(1, 8) == 1


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_programs_fit_program_memory(name):
    gen = LIBRARY[name]
    for world in (2, 4, 8):
        prog = gen(0, world, 2) if name == "hierarchical_allreduce" else gen(0, world)
        assert prog[-1].op is SeqOp.DONE
        assert len(assemble(prog)) <= 256, f"{name} at world {world}"
        assert str(prog[0]).startswith("SETUP")


def test_library_programs_pass_the_static_check():
    from fpgaccl.proto.isa import checked_program
    for name, make in LIBRARY.items():
        for world in (2, 3, 4, 5, 8):
            for rank in range(world):
                if name == "hierarchical_allreduce":
                    if world % 2:
                        continue
                    prog = make(rank, world, 2)
                else:
                    prog = make(rank, world)
                assert checked_program(prog, rank, world) == prog


@pytest.mark.parametrize("program, why", [
    ([Instr(SeqOp.SEND, peer=1, step=0x8000), Instr(SeqOp.DONE)], "15-bit message tag"),
    ([Instr(SeqOp.GRANT, peer=4), Instr(SeqOp.DONE)], "peer 4 is not another rank"),
    ([Instr(SeqOp.RECV, peer=0), Instr(SeqOp.DONE)], "peer 0 is not another rank"),
    ([Instr(SeqOp.SETUP, step=0), Instr(SeqOp.DONE)], "SETUP of zero chunks"),
    ([Instr(SeqOp.SETUP, step=2), Instr(SeqOp.COPY, chunk=1, count=2), Instr(SeqOp.DONE)],
     "beyond the 2 of the last SETUP"),
    ([Instr(SeqOp.SEND, peer=1, chunk=256), Instr(SeqOp.DONE)], "does not fit 8 bits"),
    ([Instr(SeqOp.SETUP, step=2), Instr(SeqOp.RECV_REDUCE, peer=1, rbuf=Buf.TMP, xchunk=2),
      Instr(SeqOp.DONE)], "chunks \\[2, 3\\) of TMP are beyond"),
    ([Instr(SeqOp.SEND, peer=1)], "no DONE"),
    ([Instr(SeqOp.NOP), "SEND"], "instruction 1 is a str"),
])
def test_check_program_names_the_first_instruction_that_cannot_run(program, why):
    from fpgaccl.proto.isa import checked_program
    with pytest.raises(ValueError, match=why):
        checked_program(program, 0, 4)


def test_checked_program_gives_enum_fields_for_ints():
    from fpgaccl.proto.isa import checked_program
    got = checked_program([Instr(2, buf=1, src=0), Instr(15)], 0, 1)  # COPY OUT <- IN
    assert got == [Instr(SeqOp.COPY, buf=Buf.OUT, src=Buf.IN), Instr(SeqOp.DONE)]
    assert got[0].op is SeqOp.COPY and got[0].buf is Buf.OUT
    with pytest.raises(ValueError, match="instruction 0"):
        checked_program([Instr(9)], 0, 1)  # no op 9
