"""Shared pytest fixtures and hypothesis strategies."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st

from fpgaccl.proto import Header

settings.register_profile("fpgaccl", max_examples=150, deadline=None)
settings.load_profile("fpgaccl")


def header_values(header: Header) -> st.SearchStrategy[dict[str, int]]:
    """Any value for every field, valid or not: layouts must agree on all bits."""
    return st.fixed_dictionaries(
        {f.name: st.integers(0, (1 << f.bits) - 1) for f in header})
