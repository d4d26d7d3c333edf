"""Prints 'N passed, N failed[, N skipped]' from Meson's JSON test logs (one object per line).

Takes one log or several (the plain build's, then the sanitizer builds' of scripts/sanitize.sh),
and counts every test of every log. A log that is missing counts as one failed test: its build or
its run did not get as far as testing. Before the count, each failed test is named with the last
lines of its output, so that a log that keeps only its end (CI's) still says what failed."""
import json
import os
import sys

# What is printed of a failed test's output: each of its first few Catch2 failures (the line
# that says "FAILED:" and those after it) and its last lines.
FAILURES_SHOWN, LINES_PER_FAILURE, TAIL_LINES = 3, 12, 15


def show_failure(path, test):
    lines = (test.get("stdout") or "").rstrip("\n").split("\n")
    print(f"FAILED {test.get('name')} ({test.get('result')}, exit {test.get('returncode')}, "
          f"{path})")
    starts = [i for i, text in enumerate(lines) if text.rstrip().endswith("FAILED:")]
    for start in starts[:FAILURES_SHOWN]:
        for text in lines[max(0, start - 1):start + LINES_PER_FAILURE]:
            print(f"    {text}")
        print("    ...")
    print("  its output ends:")
    for text in lines[-TAIL_LINES:]:
        print(f"    {text}")


counts = {"passed": 0, "failed": 0, "skipped": 0}
failures = []
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"no test log at {path}: counted as one failure", file=sys.stderr)
        counts["failed"] += 1
        continue
    with open(path) as log:
        for line in log:
            test = json.loads(line)
            result = test.get("result")
            if result in ("OK", "EXPECTEDFAIL"):
                counts["passed"] += 1
            elif result == "SKIP":
                counts["skipped"] += 1
            else:
                counts["failed"] += 1
                failures.append((path, test))
for path, test in failures:
    show_failure(path, test)
line = f"{counts['passed']} passed, {counts['failed']} failed"
if counts["skipped"]:
    line += f", {counts['skipped']} skipped"
print(line)
