"""Judge checkov's JSON report: fail on any finding not accepted with a reason, and on parsing errors.

checkov exits 0 when it cannot parse a file (it just skips it), and an inline skip without a
reason reads "No comment provided": both count as failures here.
python -m ops.check.checkov_report REPORT.json [FRAMEWORK ...]  (frameworks that must have scanned something)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NO_REASON = {"", "No comment provided"}


def judge(report: Any, required_frameworks: tuple[str, ...] = ()) -> list[str]:
    """Every problem in a checkov JSON report (a dict per framework, or a list of them)."""
    reports = report if isinstance(report, list) else [report]
    problems = []
    scanned = set()
    for r in reports:
        kind = r.get("check_type", "?")
        results = r.get("results") or {}
        summary = r.get("summary") or {}
        if summary.get("resource_count", 0) > 0:
            scanned.add(kind)
        for path in results.get("parsing_errors") or []:
            problems.append(f"{kind}: checkov could not parse {path}")
        if summary.get("parsing_errors") and not results.get("parsing_errors"):
            problems.append(f"{kind}: checkov could not parse {summary['parsing_errors']} file(s)")
        for c in results.get("failed_checks") or []:
            lines = c.get("file_line_range") or ["?"]
            problems.append(f"{kind}: {c.get('file_path')}:{lines[0]} {c.get('resource')}: {c.get('check_id')} {c.get('check_name')}")
        for c in results.get("skipped_checks") or []:
            reason = ((c.get("check_result") or {}).get("suppress_comment") or "").strip()
            if reason in NO_REASON:
                problems.append(f"{kind}: {c.get('file_path')} {c.get('resource')}: {c.get('check_id')} skipped without a reason")
    for kind in required_frameworks:
        if kind not in scanned:
            problems.append(f"{kind}: checkov scanned no resources (nothing parsed?)")
    return problems


def main(argv: list[str]) -> int:
    report = json.loads(Path(argv[0]).read_text() or "[]")
    problems = judge(report, tuple(argv[1:]))
    for p in problems:
        print(p)
    print(f"checkov: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
