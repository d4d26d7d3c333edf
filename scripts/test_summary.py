"""Prints 'N passed, N failed[, N skipped]' from Meson's JSON test logs (one object per line).

Takes one log or several (the plain build's, then the sanitizer builds' of scripts/sanitize.sh),
and counts every test of every log. A log that is missing counts as one failed test: its build or
its run did not get as far as testing."""
import json
import os
import sys

counts = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"no test log at {path}: counted as one failure", file=sys.stderr)
        counts["failed"] += 1
        continue
    with open(path) as log:
        for line in log:
            result = json.loads(line).get("result")
            if result in ("OK", "EXPECTEDFAIL"):
                counts["passed"] += 1
            elif result == "SKIP":
                counts["skipped"] += 1
            else:
                counts["failed"] += 1
line = f"{counts['passed']} passed, {counts['failed']} failed"
if counts["skipped"]:
    line += f", {counts['skipped']} skipped"
print(line)
