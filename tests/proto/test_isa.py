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
