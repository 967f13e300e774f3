"""The self-test's rows, its table and its exit status."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PASS = "pass"
FAIL = "FAIL"
INFO = "info"  # a measurement (memory sizing, throughput): nothing to pass or fail


def skipped(why: str) -> str:
    """The status of a check that did not run, with the reason (never reported as a pass)."""
    return f"skipped: {why}"


@dataclass(frozen=True)
class Row:
    """One line of the table: ``status`` is PASS, FAIL, INFO or ``skipped(...)``."""

    section: str  # "exactness" | "memory" | "throughput"
    check: str
    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def format_table(rows: Sequence[Row]) -> str:
    """Aligned columns: section, check, status, detail (the detail may be long; it comes last)."""
    head = ("section", "check", "result", "detail")
    cells = [head, *((r.section, r.check, r.status, r.detail) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = []
    for i, c in enumerate(cells):
        lines.append("  ".join(c[j].ljust(widths[j]) for j in range(3)) + "  " + c[3])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(head[3]))
    return "\n".join(line.rstrip() for line in lines)


def summary(rows: Sequence[Row]) -> str:
    n_pass = sum(r.status == PASS for r in rows)
    n_fail = sum(r.failed for r in rows)
    n_skip = sum(r.status.startswith("skipped") for r in rows)
    verdict = "MISMATCH" if n_fail else "OK"
    return f"selftest: {verdict}: {n_pass} passed, {n_fail} failed, {n_skip} skipped"


def exit_status(rows: Sequence[Row]) -> int:
    """0 when no row failed, 1 otherwise (a skipped check is neither)."""
    return 1 if any(r.failed for r in rows) else 0
