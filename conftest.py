"""Suite-wide reporting: every skipped test is named at the end of the run, with its reason.

pytest's own short summary (``-ra``) folds skips that share a location into
one line, so a shared suite skipped on one engine reads like any other skip.
A skip that hides a regression should be visible where the run ends: this
section lists each skipped test by id, just above pytest's closing lines.
"""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "nodeid", "")]
    if not skipped:
        return
    terminalreporter.write_sep("=", f"skipped tests ({len(skipped)}), and why")
    for report in sorted(skipped, key=lambda r: r.nodeid):
        reason = ""
        if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason}")
