"""docs/api.md's error table is the one in gpusnap/errors.py."""

from __future__ import annotations

from pathlib import Path

from gpusnap.errors import ERROR_TABLE

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_error_table_in_docs_matches_error_table() -> None:
    text = DOC.read_text()
    block = text.split("<!-- error-table:start -->")[1].split("<!-- error-table:end -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        kind, code, exit_code = (c.strip().strip("`") for c in line.strip("|").split("|"))
        rows[kind] = (code, int(exit_code))
    assert rows == {k: (m.grpc_code, m.exit_code) for k, m in ERROR_TABLE.items()}
