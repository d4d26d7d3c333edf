"""Runs Horovod's PyTorch test suite (test/parallel/test_torch.py of Horovod's public repository)
against kolo.torch, with only the import changed: the `horovod` package beside this script makes
`import horovod.torch as hvd` load kolo.torch. Nothing of Horovod is copied into kolo; the suite is
read from a checkout given on the command line.

Usage:
  run_suite.py HOROVOD [--np N] [--mode each|one|both] [-k EXPR] [--timeout S] [--kolorun PATH]

HOROVOD is a checkout of github.com/horovod/horovod (a working tree, or a git directory, whose
HEAD's test/ is then extracted to a temporary directory). Without it the script prints why it
skips and exits 77 (Meson's "skipped"): CI has no internet.

--mode each runs every test in a kolorun job of its own, --mode one runs them all in one job
(where a failed collective must not knock the ranks out of step for the tests after it), both
(the default) does both. A test passes when it passes on every rank, is skipped when every rank
skipped it, and fails otherwise. Prints one line per test and the counts; exits 1 if any test
failed. Needs KOLO_LIBRARY (or an installed kolo), Debian's python3-torch, -pytest, -mock,
-cloudpickle and -packaging (Horovod's test utilities import them).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.join("test", "parallel", "test_torch.py")


def find_suite(path, scratch):
    """The path of test_torch.py in a working tree, or extracted from a git directory."""
    if os.path.isfile(os.path.join(path, SUITE)):
        return os.path.join(path, SUITE)
    listing = subprocess.run(["git", "--git-dir", path, "ls-tree", "HEAD", SUITE],
                             capture_output=True, text=True)
    if listing.returncode != 0 or not listing.stdout.strip():
        sys.exit(f"run_suite.py: {path} holds no {SUITE} (neither a working tree of Horovod "
                 f"nor a git directory whose HEAD has it)")
    archive = subprocess.run(["git", "--git-dir", path, "archive", "HEAD", "test"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
    return os.path.join(scratch, SUITE)


def environment(suite):
    env = dict(os.environ)
    utils = os.path.join(os.path.dirname(os.path.dirname(suite)), "utils")
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.join(SOURCE, "python"), utils] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("KOLO_TIMEOUT", "30")  # a failing test is reported, not waited on for long
    env.setdefault("KOLO_TRANSPORT", "tcp")
    return env


def collect(suite, env, expression):
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               suite] + (["-k", expression] if expression else [])
    listing = subprocess.run(command, capture_output=True, text=True, env=env)
    ids = [line.split("::", 1)[1] for line in listing.stdout.splitlines() if "::" in line]
    if not ids:
        sys.exit(f"run_suite.py: collected no tests from {suite}:\n{listing.stdout}"
                 f"{listing.stderr}")
    return ids


def outcomes(report_dir, ranks):
    """{test name: (outcome, message)} over the ranks' JUnit reports; a rank without a report
    (killed, timed out) fails every test."""
    merged = {}
    for rank in range(ranks):
        path = os.path.join(report_dir, f"rank{rank}.xml")
        if not os.path.exists(path):
            return None
        for case in ElementTree.parse(path).getroot().iter("testcase"):
            name = case.get("name")
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            if failure is not None:
                outcome = ("fail", f"rank {rank}: {failure.get('message', '')}")
            elif case.find("skipped") is not None:
                outcome = ("skip", case.find("skipped").get("message", ""))
            else:
                outcome = ("pass", "")
            previous = merged.get(name)
            order = {"fail": 2, "pass": 1, "skip": 0}
            if previous is None or order[outcome[0]] > order[previous[0]]:
                merged[name] = outcome
    return merged


def run_job(kolorun, ranks, suite, test_ids, env, timeout):
    """Runs test_ids in one kolorun job; returns {test: (outcome, message)} and the job's
    output."""
    report_dir = tempfile.mkdtemp(prefix="kolo-hvd-")
    try:
        command = [kolorun, "-np", str(ranks), "--timeout", str(timeout), "--",
                   sys.executable, os.path.join(HERE, "rank_pytest.py"), report_dir, suite]
        job = subprocess.run(command + test_ids, capture_output=True, text=True, env=env)
        results = outcomes(report_dir, ranks) or {}
        why = "the job ended without every rank's report (exit status %d)" % job.returncode
        for test_id in test_ids:
            results.setdefault(test_id.split("::")[-1], ("fail", why))
        return results, job.stdout + job.stderr
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def report(title, results):
    counts = {"pass": 0, "fail": 0, "skip": 0}
    print(f"== {title}")
    for name in sorted(results):
        outcome, message = results[name]
        counts[outcome] += 1
        first_line = message.strip().splitlines()[0][:160] if message.strip() else ""
        print(f"{outcome.upper():4} {name}" + (f"  ({first_line})" if first_line else ""))
    print(f"== {title}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} "
          f"skipped, {len(results)} in all", flush=True)
    return counts["fail"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("horovod", nargs="?", help="a checkout of Horovod's repository")
    parser.add_argument("--np", type=int, default=2, help="ranks per job (2)")
    parser.add_argument("--mode", choices=["each", "one", "both"], default="both")
    parser.add_argument("-k", dest="expression", help="pytest -k expression selecting tests")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds one job of one test may run (600; the one job gets 30x)")
    parser.add_argument("--kolorun", default=os.environ.get("KOLORUN", os.path.join(
        SOURCE, "build", "src", "kolorun")), help="the kolorun to start jobs with")
    parser.add_argument("--verbose", action="store_true", help="print every failing job's output")
    args = parser.parse_args()
    if not args.horovod:
        print("SKIP: no Horovod checkout given (run_suite.py PATH; get one with git clone "
              "https://github.com/horovod/horovod): nothing to judge kolo.torch against")
        return 77
    scratch = tempfile.mkdtemp(prefix="kolo-hvd-suite-")
    try:
        suite = find_suite(args.horovod, scratch)
        env = environment(suite)
        test_ids = collect(suite, env, args.expression)
        failed = 0
        if args.mode in ("each", "both"):
            results = {}
            for test_id in test_ids:
                result, output = run_job(args.kolorun, args.np, suite, [test_id], env,
                                         args.timeout)
                results.update(result)
                name = test_id.split("::")[-1]
                outcome, message = results[name]
                detail = message.strip().splitlines()[0][:200] if message.strip() else ""
                print(f"{outcome.upper():4} {name}" + (f"  ({detail})" if outcome == "fail"
                                                      else ""), flush=True)
                if args.verbose and results[name][0] == "fail":
                    print(output[-4000:], flush=True)
            failed += report(f"each test in a job of its own (N={args.np})", results)
        if args.mode in ("one", "both"):
            results, output = run_job(args.kolorun, args.np, suite, test_ids, env,
                                      args.timeout * 30)
            if args.verbose:
                print(output[-20000:], flush=True)
            failed += report(f"all tests in one job (N={args.np})", results)
        return 1 if failed else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
