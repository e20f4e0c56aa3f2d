"""A failed open-flow build says why: yosys runs with -q -l top.rpt and writes its ERROR
there only, so the error raised must carry that log's end, not just build.log's."""

from __future__ import annotations

from ._deps import needs_boards

pytestmark = needs_boards

REPORT_END = """\
2.46.29.7. Executing ABC_OPS_REINTEGRATE pass (reintegrate ABC mapped design into module).
<suppressed ~179563 debug messages>
ERROR: Assert `GetSize(conn.first) == GetSize(conn.second)' failed in kernel/rtlil.cc:3091.
"""


def test_yosys_error_in_its_report_reaches_the_failure(tmp_path):
    from fpgaccl.boards.build import failure_tail
    (tmp_path / "build.log").write_text("")
    (tmp_path / "top.rpt").write_text("".join(f"line {i}\n" for i in range(500)) + REPORT_END)
    tail = failure_tail(tmp_path)
    assert "--- top.rpt (yosys's log)" in tail
    assert "ABC_OPS_REINTEGRATE" in tail and tail.rstrip().endswith("rtlil.cc:3091.")
    assert "line 100\n" not in tail                   # the end of the report, not all of it


def test_errors_already_in_build_log_are_not_repeated(tmp_path):
    from fpgaccl.boards.build import failure_tail
    err = "ERROR: Max frequency not met"
    (tmp_path / "build.log").write_text(f"nextpnr stderr\n{err}\n")
    (tmp_path / "top.tim").write_text(f"Info: placing\n{err}\n")
    (tmp_path / "top.rpt").write_text("yosys finished\n")
    tail = failure_tail(tmp_path)
    assert tail.count(err) == 1 and "---" not in tail
