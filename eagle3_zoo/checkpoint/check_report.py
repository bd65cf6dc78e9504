"""What a check of a drafter folder reports: each `Problem` (stable code, message, fix, severity), the `CheckReport`
of one folder, and the errors that carry a report. Shared by the folder checks (`check`) and the checks against the
target's config (`check_target`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eagle3_zoo.modeling import Eagle3Config


@dataclass
class Problem:
    """One finding: a stable `code`, what is wrong (`message`) and how to fix it (`fix`)."""

    code: str
    message: str
    fix: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.message}\n    fix: {self.fix}"


@dataclass
class CheckReport:
    """All problems found in one drafter folder (and against one target config, when given)."""

    path: str
    format: str | None = None
    problems: list[Problem] = field(default_factory=list)
    config: Eagle3Config | None = None

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def codes(self) -> list[str]:
        return [p.code for p in self.problems]

    def add(self, code: str, message: str, fix: str, severity: Literal["error", "warning"] = "error") -> None:
        self.problems.append(Problem(code, message, fix, severity))

    def __str__(self) -> str:
        head = f"{self.path} ({self.format or 'unknown format'}): {len(self.errors)} error(s), " \
               f"{len(self.warnings)} warning(s)"
        return "\n".join([head, *(str(p) for p in self.problems)])

    def raise_for_errors(self) -> None:
        """Raise `DrafterCheckError` (listing every error) when the report has errors."""
        if self.errors:
            raise DrafterCheckError(self)


class DrafterCheckError(ValueError):
    """Raised by `CheckReport.raise_for_errors`; carries the report."""

    def __init__(self, report: CheckReport):
        self.report = report
        super().__init__(str(report))


class InvalidDrafterError(DrafterCheckError):
    """Raised by `require_valid_drafter`: one line with every error's code, message and fix."""

    def __init__(self, report: CheckReport, purpose: str):
        found = "; ".join(f"{p.code}: {p.message} (fix: {p.fix})" for p in report.errors).replace("\n", " ")
        ValueError.__init__(self, f"{report.path}: refusing to {purpose} an invalid drafter: {found}")
        self.report = report
