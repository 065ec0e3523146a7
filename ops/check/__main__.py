"""python -m ops.check [ROOT]: print every finding, exit 1 if there is one."""

from __future__ import annotations

import sys
from pathlib import Path

from ops.check.project import check_project


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else ".").resolve()
    findings = check_project(root)
    for finding in findings:
        print(finding)
    print(f"ops.check: {len(findings)} finding(s) in {root}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
