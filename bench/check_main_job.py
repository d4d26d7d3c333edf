#!/usr/bin/python3
"""bench/main_job.sh (what scripts/bench.sh runs) on a small grid: two rounds of kolo and Open MPI
at N = 2, 8 B to 4 KiB. The table must hold every size once, with the times of both, Open MPI's
time over kolo's computed from them, a verdict line, and the same medians in main_job.tsv (and a
PNG where gnuplot is installed); an unknown argument exits 2, a build without the programs 1.

Usage: check_main_job.py SOURCE_ROOT BUILD_DIR"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

SOURCE_ROOT, BUILD_DIR = sys.argv[1], sys.argv[2]
SCRIPT = os.path.join(SOURCE_ROOT, "bench", "main_job.sh")
failures = []


def fail(what):
    failures.append(what)
    print("FAIL:", what, flush=True)


def run(env_extra, *arguments):
    env = dict(os.environ, **env_extra)
    return subprocess.run(["bash", SCRIPT, *arguments], capture_output=True, text=True,
                          timeout=240, env=env, cwd=SOURCE_ROOT)


with tempfile.TemporaryDirectory() as out_dir:
    result = run({"BUILD": BUILD_DIR, "OUT_DIR": out_dir, "RANKS": "2", "ROUNDS": "2",
                  "MAX_BYTES": "4K", "SMALL_ITERS": "5", "SMALL_WARMUP": "2"})
    print(result.stdout)
    if result.returncode != 0:
        fail(f"exit {result.returncode}: {result.stderr[-2000:]}")
    rows = re.findall(r"^ +(\d+ (?:B|KiB)) +([\d.]+) +([\d.]+) +[\d.]+ GB/s +[\d.]+ GB/s +([\d.]+)x$",
                      result.stdout, re.MULTILINE)
    if [row[0] for row in rows] != ["8 B", "64 B", "512 B", "4 KiB"]:
        fail(f"table rows {rows}")
    for size, kolo, mpi, speed in rows:
        # The table rounds each figure to 2 decimals, so the ratio of the printed times is known
        # only within what that rounding allows (wide where kolo's time is 0.30 us).
        low = (float(mpi) - 0.005) / (float(kolo) + 0.005) - 0.005
        high = (float(mpi) + 0.005) / max(float(kolo) - 0.005, 1e-9) + 0.005
        if not low <= float(speed) <= high:
            fail(f"{size}: Open MPI {mpi} us over kolo {kolo} us is not {speed}")
    if not re.search(r"^verdict N = 2: kolo is ", result.stdout, re.MULTILINE):
        fail("no verdict line for N = 2")
    try:
        with open(os.path.join(out_dir, "main_job.tsv")) as file:
            lines = [line.split("\t") for line in file if not line.startswith("#")]
        if [int(line[1]) for line in lines] != [8, 64, 512, 4096] or \
                any(line[0] != "2" for line in lines):
            fail(f"main_job.tsv: {lines}")
    except OSError as error:
        fail(f"no main_job.tsv: {error}")
    if shutil.which("gnuplot") and not os.path.getsize(os.path.join(out_dir, "main_job.png")):
        fail("gnuplot is installed, yet no main_job.png")

result = run({}, "--no-such-flag")
if result.returncode != 2 or "--no-such-flag" not in result.stderr:
    fail(f"an unknown argument: exit {result.returncode}, {result.stderr!r}")
result = run({"BUILD": "/nonexistent"})
if result.returncode != 1 or "is not built" not in result.stderr:
    fail(f"no build: exit {result.returncode}, {result.stderr!r}")

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
