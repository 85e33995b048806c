"""The result of ``verify``: one Row per check, and a Report that renders them as a table."""

from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, WARN, NA = "pass", "fail", "warn", "n/a"


@dataclass(frozen=True)
class Row:
    """check name, measured value (None when not applicable), threshold as text, status
    (pass / fail / warn / n/a) and a message that names the fault when it fails."""

    check: str
    value: float | None
    threshold: str
    status: str
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def judged(check: str, value: float, ok: bool, threshold: str, good: str, fault: str) -> Row:
    """A pass/fail row: message ``good`` when ok, else ``fault``."""
    return Row(check, value, threshold, PASS if ok else FAIL, good if ok else fault)


def not_applicable(check: str, why: str) -> Row:
    return Row(check, None, "-", NA, why)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings and n/a rows do not fail a model)."""
        return not any(r.failed for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.failed]

    def row(self, check: str) -> Row:
        for r in self.rows:
            if r.check == check:
                return r
        raise KeyError(f"no check {check!r}; checks: {[r.check for r in self.rows]}")

    def table(self) -> str:
        """Fixed-width text: check, value, threshold, status, message."""
        head = ("check", "value", "threshold", "status", "message")
        body = [(r.check, _fmt(r.value), r.threshold, r.status.upper(), r.message) for r in self.rows]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(4)]
        lines = [self.note] if self.note else []
        for line in [head, *body]:
            lines.append("  ".join(f"{cell:<{w}}" for cell, w in zip(line[:4], widths)) + "  " + line[4])
        verdict = "all checks passed" if self.ok else f"{len(self.failures)} check(s) FAILED"
        return "\n".join([*lines, verdict])

    def __str__(self) -> str:
        return self.table()


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.2e}"
