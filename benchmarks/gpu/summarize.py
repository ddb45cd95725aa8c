"""Summary lines and the combined results file of scripts/gpu_check.sh.

    summarize.py line CHECK --rc N --seconds S --budget B [--json FILE] [--log FILE]
        one line, `STATUS check: key numbers (S s of B s)`, from a benchmark's JSON result
        (its own PASS / FAIL / SKIP), or TIMEOUT when the check was stopped at its budget,
        or FAIL with the log's last line when it ended without a result
    summarize.py tests --junit FILE --rc N --json-out FILE
        the same for pytest's JUnit XML: PASS (all ran passed), SKIP (all skipped), FAIL
        (the failing tests named); also written as a JSON result
    summarize.py combine --work DIR --out FILE --summary FILE --checks NAMES...
        every check's JSON result and summary line in one JSON file

Uses only the standard library (it runs even when torch or shardwise fail to import).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

TIMEOUT_CODES = (124, 137)  # coreutils timeout: TERM sent; KILL sent after --kill-after
STATUSES = ("PASS", "FAIL", "SKIP", "TIMEOUT")


def last_json(path: Path | None) -> dict | None:
    """The last line of `path` that parses as a JSON object, or None."""
    if path is None or not path.exists():
        return None
    for text in reversed(path.read_text(errors="replace").splitlines()):
        text = text.strip()
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                continue
    return None


def last_line(path: Path | None) -> str:
    if path is None or not path.exists():
        return "no log"
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:240] if lines else "no output"


def summary_line(check: str, rc: int, seconds: float, budget: float, result: dict | None, log: Path | None) -> str:
    timing = f"({seconds:.0f} s of {budget:.0f} s)"
    if rc in TIMEOUT_CODES:
        partial = f"; last: {last_line(log)}" if log is not None else ""
        return f"TIMEOUT {check}: stopped at its budget {timing}{partial}"
    if result is None:
        return f"FAIL {check}: exit {rc} without a result: {last_line(log)} {timing}"
    status = result.get("status", "FAIL")
    if status not in STATUSES:
        status = "FAIL"
    return f"{status} {check}: {result.get('summary', '')} {timing}"


def junit_result(path: Path, rc: int) -> dict:
    """Counts and failing test names from pytest's JUnit XML, as a benchmark-style result."""
    if not path.exists():
        return {"check": "tests", "status": "FAIL", "summary": f"pytest exit {rc}, no JUnit report"}
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing, skip_reasons = [], set()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for child in case:
            if child.tag in ("failure", "error"):
                message = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
                failing.append(f"{name} ({message})" if message else name)
            elif child.tag == "skipped":
                skip_reasons.add((child.get("message") or "")[:80])
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    text = (f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
            f" of {counts['tests']}")
    if failing:
        status, text = "FAIL", text + ": " + "; ".join(failing[:4]) + (" ..." if len(failing) > 4 else "")
    elif counts["tests"] == 0 or (rc not in (0, 5) and not failing):
        status, text = "FAIL", text + f" (pytest exit {rc})"
    elif passed == 0:
        status, text = "SKIP", text + (f" ({'; '.join(sorted(skip_reasons))})" if skip_reasons else "")
    else:
        status = "PASS"
    return {"check": "tests", "status": status, "summary": text, **counts, "passed": passed, "failing": failing}


def combine(work: Path, checks: list[str], summary: Path, out: Path) -> None:
    lines = summary.read_text().splitlines() if summary.exists() else []
    results = {"summary": lines, "checks": {}}
    for check in checks:
        results["checks"][check] = last_json(work / f"{check}.json")
    environment = work / "environment.json"
    if environment.exists():
        results["environment"] = json.loads(environment.read_text())
    out.write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    line = commands.add_parser("line", help="one check's summary line")
    line.add_argument("check")
    line.add_argument("--rc", type=int, required=True)
    line.add_argument("--seconds", type=float, required=True)
    line.add_argument("--budget", type=float, required=True)
    line.add_argument("--json", type=Path, default=None)
    line.add_argument("--log", type=Path, default=None)
    tests = commands.add_parser("tests", help="pytest's JUnit XML as a result")
    tests.add_argument("--junit", type=Path, required=True)
    tests.add_argument("--rc", type=int, required=True)
    tests.add_argument("--json-out", type=Path, required=True)
    together = commands.add_parser("combine", help="all results in one JSON file")
    together.add_argument("--work", type=Path, required=True)
    together.add_argument("--out", type=Path, required=True)
    together.add_argument("--summary", type=Path, required=True)
    together.add_argument("--checks", nargs="+", required=True)
    args = parser.parse_args()
    if args.command == "line":
        print(summary_line(args.check, args.rc, args.seconds, args.budget, last_json(args.json), args.log))
    elif args.command == "tests":
        if args.rc in TIMEOUT_CODES:
            return  # the line says TIMEOUT; a partial report would count too few tests
        args.json_out.write_text(json.dumps(junit_result(args.junit, args.rc)) + "\n")
    else:
        combine(args.work, args.checks, args.summary, args.out)
    sys.exit(0)


if __name__ == "__main__":
    main()
