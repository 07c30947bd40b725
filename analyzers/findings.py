"""The `Finding` record every analyzer returns, and the severity order."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("critical", "warning", "info")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}

GUIDE = "docs/tuning.md"  # the project's tuning guide; every finding links to one of its sections


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what is wrong, the numbers that show it, and what to change.

    `evidence` holds the measured numbers (units in the key names) and the SQL
    that produced them under the key `query`. `reference` links the section of
    docs/tuning.md the advice comes from.
    """

    id: str
    title: str
    severity: str  # 'info' | 'warning' | 'critical'
    evidence: dict[str, Any]
    suggestion: str
    expected_effect: str
    reference: str
    run_id: str | None = None
    thresholds: dict[str, Any] = field(default_factory=dict)
    # what a person reads first (`diagnose`'s default view, the dashboard's first line): one sentence each.
    # summary: what is wrong, with its numbers; action: what to change -> what it gains. "" (an analyzer that
    # gives none): the first sentence of expected_effect and of suggestion (`brief`)
    summary: str = ""
    action: str = ""

    def __post_init__(self) -> None:
        if self.severity not in _RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")
        if "query" not in self.evidence:
            raise ValueError(f"finding {self.id!r}: evidence must carry the 'query' that produced it")

    def brief(self) -> tuple[str, str]:
        """(what is wrong, with its numbers; what to change -> what it gains), one sentence each."""
        return (self.summary or first_sentence(self.expected_effect),
                self.action or first_sentence(self.suggestion))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN/inf become None); summary and action filled in (`brief`)."""
        d = asdict(self)
        d["summary"], d["action"] = self.brief()
        return _clean(d)


def first_sentence(text: str) -> str:
    """`text` up to the end of its first sentence: a '.', '!' or '?' followed by a space or the end, outside
    brackets (so '(p95 1.2 s. now)' and '3.5 ms' do not end it)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch in ".!?" and depth == 0 and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i + 1]
    return text


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def severity_rank(severity: str) -> int:
    """0 for critical, 1 warning, 2 info (sort key)."""
    return _RANK[severity]


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first, then by id (stable, deterministic)."""
    return sorted(findings, key=lambda f: (severity_rank(f.severity), f.id))


def anchor(heading: str) -> str:
    """The Markdown anchor of a heading, as GitHub and most renderers make it."""
    import re

    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).strip().replace(" ", "-")


def ref(section: str) -> str:
    """A link to a section (its `## ` heading) of the tuning guide, e.g. docs/tuning.md#prefill."""
    return f"{GUIDE}#{anchor(section)}"
