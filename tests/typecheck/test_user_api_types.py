"""The public API's annotations, as a user's type checker sees them.

``user_api.py`` (a typed user script and engine subclass) must pass mypy
under the project's configuration, and ``user_api_errors.py`` must get
exactly the errors its ``# E: <code>`` comments name: if a public name
degraded to ``Any`` or the configuration stopped checking these files, the
expected errors would vanish and this test fails.
"""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GOOD = HERE / "user_api.py"
BAD = HERE / "user_api_errors.py"
_REPORTED = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _expected(path: Path) -> set[tuple[str, int, str]]:
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        marker = re.search(r"# E: (?P<code>[a-z-]+)$", line)
        if marker:
            found.add((path.name, number, marker["code"]))
    return found


def test_user_script_type_checks_and_mistakes_are_reported() -> None:
    # The project's own settings and cache (warm after `make lint`), on exactly these two files.
    stdout, stderr, _status = api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"), str(GOOD), str(BAD)]
    )
    reported = set()
    for line in stdout.splitlines():
        match = _REPORTED.match(line)
        if match:
            reported.add((Path(match["path"]).name, int(match["line"]), match["code"]))
    expected = _expected(BAD)
    assert len(expected) >= 10, "the error script lost its markers"
    assert reported == expected, f"mypy output:\n{stdout}{stderr}"
