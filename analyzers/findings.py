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


# severity weighted by the share of the run a finding covers (its evidence's `affected_share`, 0..1, of what
# `affected_of` names: decode steps, prefill tokens, prompt tokens, busy samples): a cause that touched under
# MIN_SHARE_WARNING of it is info at most, under MIN_SHARE_CRITICAL a warning at most, whatever its size per case
MIN_SHARE_WARNING = 0.01
MIN_SHARE_CRITICAL = 0.10


def weigh(f: Finding) -> Finding:
    """`f` with its severity capped by the share of steps or tokens it covers (`MIN_SHARE_*`); a finding
    without `affected_share` in its evidence, or one the cap leaves as it is, is returned unchanged. A capped
    finding's evidence keeps the severity its analyzer gave (`severity_unweighted`)."""
    share = f.evidence.get("affected_share")
    if not isinstance(share, (int, float)) or not math.isfinite(share):
        return f
    cap = "info" if share < MIN_SHARE_WARNING else "warning" if share < MIN_SHARE_CRITICAL else "critical"
    if _RANK[f.severity] >= _RANK[cap]:
        return f
    from dataclasses import replace

    return replace(f, severity=cap, evidence={**f.evidence, "severity_unweighted": f.severity})


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
