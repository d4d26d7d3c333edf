#!/usr/bin/python3
"""nccl-tests' command lines, run unchanged against kolo's benchmarks, their output read the way a
parser of nccl-tests' output reads it.

For each of nccl-tests' seven binaries (all_reduce_perf, all_gather_perf, broadcast_perf,
reduce_perf, reduce_scatter_perf, alltoall_perf, sendrecv_perf): nccl-tests' README example,
`<binary> -b 8 -e 128M -f 2 -g 1`, with -e scaled down so that it takes seconds, run alone (a world
of one, no launcher) and under kolorun at N = 2 and 4. The output must be one table in nccl-tests'
layout: every line that is not a row starts with "#" (no launcher prefix), the parameter line
first, the column header, 13 fields per row, sizes rising by the factor, busbw = algbw times the
collective's factor, algbw = size / time, no wrong element, "# Out of bounds values : 0 OK" and
"# Avg bus bandwidth : X" with X the mean of the busbw columns, printed once (by rank 0 alone).
Then the flags: an unknown one exits 2, -m, -N, -c, -C, -S, -M, -J and -w 0 do what nccl-tests says
(and kolo's own --first prints the first calls' times), and
on a host without a usable GPU the GPU flags refuse with a sentence saying why. Last, the install
location: <libexecdir>/kolo, never <bindir>, where nccl-tests' own binaries live.

Usage: check_nccl_tests_interface.py BENCH_DIR KOLORUN"""

import json
import math
import os
import re
import subprocess
import sys
import tempfile

BENCH_DIR, KOLORUN = sys.argv[1], sys.argv[2]

# busbw / algbw for N ranks, as nccl-tests' PERFORMANCE.md defines them.
FACTORS = {
    "all_reduce_perf": lambda n: 2 * (n - 1) / n,
    "all_gather_perf": lambda n: (n - 1) / n,
    "reduce_scatter_perf": lambda n: (n - 1) / n,
    "alltoall_perf": lambda n: (n - 1) / n,
    "broadcast_perf": lambda n: 1,
    "reduce_perf": lambda n: 1,
    "sendrecv_perf": lambda n: 1,
}
# Where every rank has the whole row's count, the sizes are exactly -b, -b*f, ... up to -e.
EXACT_SIZES = {"all_reduce_perf", "broadcast_perf", "reduce_perf", "sendrecv_perf"}
COLUMNS = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
           "algbw", "busbw", "#wrong"]
PARAMETERS = re.compile(
    r"^# nThread 1 nGpus 1 minBytes (\d+) maxBytes (\d+) step: (\d+)\((factor|bytes)\) "
    r"warmup iters: (\d+) iters: (\d+) agg iters: (\d+) validation: (\d+) graph: (\d+)$")

failures = []


def fail(what):
    failures.append(what)
    print("FAIL:", what, flush=True)


def run(command, timeout=240):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def parse_table(text):
    """The table as nccl-tests' parsers read it: (parameters match, rows, summary dict)."""
    lines = text.splitlines()
    rows, summary, headers = [], {}, []
    for line in lines:
        if line.startswith("#"):
            if line.startswith("#  ") and "size" in line.split():
                headers.append(line.split()[1:])
            match = re.match(r"^# (Out of bounds values|Avg bus bandwidth)\s+: (\S+)(.*)$", line)
            if match:
                summary[match.group(1)] = (match.group(2), match.group(3).strip())
            continue
        if not line.strip():
            continue
        rows.append(line.split())
    return lines, headers, rows, summary


def check_table(label, text, program, ranks, min_bytes, max_bytes, factor, iters=20, warmup=5,
                agg=1, validation=1, cycles=1):
    lines, headers, rows, summary = parse_table(text)
    if not lines:
        fail(f"{label}: no output")
        return []
    match = PARAMETERS.match(lines[0])
    if not match:
        fail(f"{label}: the first line is not nccl-tests' parameter line: {lines[0]!r}")
    else:
        expected = (min_bytes, max_bytes, factor, "factor", warmup, iters, agg, validation, 0)
        got = tuple(int(g) if g.isdigit() else g for g in match.groups())
        if got != expected:
            fail(f"{label}: parameters {got}, expected {expected}")
    if sum(line.startswith("# nThread") for line in lines) != 1:
        fail(f"{label}: the table is printed more than once (only rank 0 prints)")
    for line in lines:
        if not (line.startswith("#") or re.match(r"^\s+\d", line) or not line.strip()):
            fail(f"{label}: a line that is neither a comment nor a row: {line!r}")
    if headers != [COLUMNS]:
        fail(f"{label}: column headers {headers}, expected {[COLUMNS]}")
    if summary.get("Out of bounds values") != ("0", "OK"):
        fail(f"{label}: out of bounds line {summary.get('Out of bounds values')}")
    busbws = []
    sizes = []
    for row in rows:
        if len(row) != 13:
            fail(f"{label}: a row of {len(row)} fields: {row}")
            continue
        size, count = int(row[0]), int(row[1])
        sizes.append(size)
        for placement in (5, 9):
            time_us, algbw, busbw, wrong = (float(row[placement]), float(row[placement + 1]),
                                            float(row[placement + 2]), row[placement + 3])
            if wrong != "0":
                fail(f"{label}: {wrong} wrong elements in row {row}")
            want_busbw = algbw * FACTORS[program](ranks)
            if abs(busbw - want_busbw) > 0.011 + 0.005 * want_busbw:
                fail(f"{label}: busbw {busbw} is not algbw {algbw} x factor in row {row}")
            if time_us >= 1.0 and size > 0:
                want_algbw = size / time_us / 1e3
                if abs(algbw - want_algbw) > 0.011 + 0.05 * want_algbw:
                    fail(f"{label}: algbw {algbw} is not size/time ({want_algbw:.3f}) in {row}")
            busbws.append(busbw)
        if count < 0 or (program in EXACT_SIZES and count * 4 != size):
            fail(f"{label}: count {count} for {size} bytes of float in row {row}")
    per_cycle = len(sizes) // cycles if cycles else 0
    if cycles and (per_cycle == 0 or sizes != sizes[:per_cycle] * cycles):
        fail(f"{label}: {len(sizes)} rows, expected {cycles} identical cycles")
    one_cycle = sizes[:per_cycle]
    if program in EXACT_SIZES:
        expected_sizes = []
        size = min_bytes
        while size <= max_bytes:
            expected_sizes.append(size)
            size *= factor
        if one_cycle != expected_sizes:
            fail(f"{label}: sizes {one_cycle}, expected {expected_sizes}")
    elif one_cycle != sorted(one_cycle) or not one_cycle or one_cycle[-1] > max_bytes:
        fail(f"{label}: sizes {one_cycle} do not rise from -b to -e")
    average = summary.get("Avg bus bandwidth")
    if average is None or not busbws:
        fail(f"{label}: no '# Avg bus bandwidth' line or no rows")
    else:
        mean = sum(busbws) / len(busbws)
        if not math.isclose(float(average[0]), mean, rel_tol=0.02, abs_tol=0.02):
            fail(f"{label}: average bus bandwidth {average[0]}, the rows' mean is {mean:.3f}")
    return rows


def launch(program, ranks, flags):
    binary = os.path.join(BENCH_DIR, program)
    if ranks == 1:
        # Alone: no launcher variable at all, as a user types it.
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("KOLO_") and k != "KOLO_TRANSPORT")}
        return subprocess.run([binary] + flags, capture_output=True, text=True, timeout=240,
                              env=env)
    return run([KOLORUN, "-np", str(ranks), "--timeout", "200", binary] + flags)


# nccl-tests' README example, with -e scaled down: 8 B .. 1 MiB alone, 8 B .. 256 KiB in a job.
for ranks, max_text, max_bytes in ((1, "1M", 1 << 20), (2, "256K", 256 << 10),
                                   (4, "256K", 256 << 10)):
    for program in FACTORS:
        label = f"{program} at N={ranks}"
        result = launch(program, ranks, ["-b", "8", "-e", max_text, "-f", "2", "-g", "1"])
        print(f"{label}: exit {result.returncode}, {len(result.stdout.splitlines())} lines",
              flush=True)
        if result.returncode != 0:
            fail(f"{label}: exit {result.returncode}: {result.stderr[-2000:]}")
            continue
        check_table(label, result.stdout, program, ranks, 8, max_bytes, 2)
        if "nThread" in result.stderr or "out-of-place" in result.stderr:
            fail(f"{label}: table lines on stderr")

# Flags: an unknown one is a usage error, with kolorun's status 2, and nothing runs.
result = launch("all_reduce_perf", 1, ["--no-such-flag"])
if result.returncode != 2 or "--no-such-flag" not in result.stderr:
    fail(f"an unknown flag: exit {result.returncode}, stderr {result.stderr!r}")

# -m (calls per timed iteration), -N (cycles), -n, -w in the parameter line and the rows.
result = launch("all_reduce_perf", 2, ["-b", "1K", "-e", "4K", "-f", "2", "-m", "3", "-N", "2",
                                       "-n", "4", "-w", "1", "-c", "2"])
if result.returncode != 0:
    fail(f"-m 3 -N 2: exit {result.returncode}: {result.stderr[-2000:]}")
else:
    check_table("-m 3 -N 2 -c 2", result.stdout, "all_reduce_perf", 2, 1024, 4096, 2, iters=4,
                warmup=1, agg=3, validation=2, cycles=2)

# --later_warmup_iters W (kolo's own): the cycles after the first warm each row up with W calls;
# the parameter line keeps -w, a line after it says W, and the rows are as with -N alone.
result = launch("all_reduce_perf", 2, ["-b", "1K", "-e", "4K", "-f", "4", "-N", "2", "-n", "2",
                                       "-w", "1", "--later_warmup_iters", "7"])
if result.returncode != 0:
    fail(f"--later_warmup_iters 7: exit {result.returncode}: {result.stderr[-2000:]}")
else:
    check_table("--later_warmup_iters 7", result.stdout, "all_reduce_perf", 2, 1024, 4096, 4,
                iters=2, warmup=1, cycles=2)
    if "# later cycles: warmup iters: 7" not in result.stdout.splitlines()[:3]:
        fail(f"--later_warmup_iters 7: no line for it after the parameters: {result.stdout[:400]}")
result = launch("all_reduce_perf", 1, ["--later_warmup_iters", "-1"])
if result.returncode != 2 or "--later_warmup_iters" not in result.stderr:
    fail(f"--later_warmup_iters -1: exit {result.returncode}, stderr {result.stderr!r}")

# -c 0: no check, so #wrong says N/A as in nccl-tests.
result = launch("broadcast_perf", 2, ["-b", "64", "-e", "64", "-c", "0", "-r", "1"])
rows = parse_table(result.stdout)[2]
if result.returncode != 0 or not rows or rows[0][8] != "N/A" or rows[0][4] != "1":
    fail(f"-c 0 -r 1: exit {result.returncode}, rows {rows}")

# -C 1 labels the time columns cputime, -S 1 adds a timestamp after each row, -M 1 reports every
# rank's buffer memory, -T sets the bound on every wait: the table is otherwise unchanged.
result = launch("all_reduce_perf", 2, ["-b", "256", "-e", "1K", "-f", "2", "-C", "1", "-S", "1",
                                       "-M", "1", "-T", "60", "-n", "2", "-w", "1"])
lines = result.stdout.splitlines()
header = [line.split()[1:] for line in lines if line.startswith("#  ") and "size" in line.split()]
stamped = [line.split() for line in lines if line and not line.startswith("#")]
memory = [line for line in lines if line.startswith("# Memory usage")]
if result.returncode != 0 or header != [COLUMNS[:5] + ["cputime"] + COLUMNS[6:9] + ["cputime"] +
                                        COLUMNS[10:] + ["timestamp"]]:
    fail(f"-C 1 -S 1: exit {result.returncode}, header {header}")
if len(stamped) != 3 or any(len(row) != 15 or not re.match(r"\d{4}-\d\d-\d\d$", row[13]) or
                            not re.match(r"\d\d:\d\d:\d\d$", row[14]) for row in stamped):
    fail(f"-S 1: rows {stamped}")
if [re.sub(r"\d+\.\d+", "X", line) for line in memory] != \
        [f"# Memory usage         : rank {r} X MB of buffers in host memory" for r in (0, 1)]:
    fail(f"-M 1: {memory}")

# -J: the same rows as the table, in a JSON file written by rank 0.
with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "table.json")
    result = launch("reduce_scatter_perf", 2, ["-b", "1K", "-e", "16K", "-f", "4", "-J", path])
    rows = parse_table(result.stdout)[2]
    try:
        with open(path) as file:
            document = json.load(file)
        sizes = [entry["size"] for entry in document["results"]]
        if sizes != [int(row[0]) for row in rows] or document["out_of_bounds"]["count"] != 0:
            fail(f"-J: JSON sizes {sizes}, table rows {rows}")
    except (OSError, ValueError, KeyError) as error:
        fail(f"-J: exit {result.returncode}, no readable JSON: {error}; {result.stderr[-500:]}")

# -w 0: no warm-up at all, the table unchanged. --first K (kolo's own): after each row one "#"
# line with the first K calls timed one by one: call 1, then the medians of calls 2-10, 11-100,
# each with its ratio to the row's timed time; the rows and summary are nccl-tests' as ever.
result = launch("all_reduce_perf", 2, ["-b", "1K", "-e", "4K", "-f", "4", "-w", "0", "-n", "3",
                                       "--first", "30"])
if result.returncode != 0:
    fail(f"-w 0 --first 30: exit {result.returncode}: {result.stderr[-2000:]}")
else:
    check_table("-w 0 --first 30", result.stdout, "all_reduce_perf", 2, 1024, 4096, 4, iters=3,
                warmup=0)
    first = [line for line in result.stdout.splitlines() if line.startswith("# first calls")]
    pattern = (r"# first calls +(\d+) B \(us, x timed\):  #1 [\d.]+ \([\d.]+x\)  "
               r"#2-10 [\d.]+ \([\d.]+x\)  #11-30 [\d.]+ \([\d.]+x\)$")
    matches = [re.match(pattern, line) for line in first]
    if not all(matches) or [int(match.group(1)) for match in matches] != [1024, 4096]:
        fail(f"--first 30: the first-call lines {first}")
result = launch("all_reduce_perf", 1, ["--first", "-1"])
if result.returncode != 2 or "--first" not in result.stderr:
    fail(f"--first -1: exit {result.returncode}, stderr {result.stderr!r}")

# The GPU flags on a run without GPU buffers: refused with a sentence, exit 2, before any job.
header = launch("all_reduce_perf", 1, ["-b", "8", "-e", "8", "-g", "1"]).stdout
if "-g 1: the buffers are in host memory" in header:
    for flags, words in ((["-G", "1"], "CUDA graph"), (["-y", "1"], "default stream"),
                         (["-R", "1"], "registers"), (["-D", "1"], "device API"),
                         (["-x", "1"], "device API")):
        result = launch("all_reduce_perf", 1, ["-g", "1", "-b", "8", "-e", "8"] + flags)
        if result.returncode != 2 or words not in result.stderr or \
                "no GPU buffers" not in result.stderr or result.stdout:
            fail(f"{flags} on a host-only run: exit {result.returncode}, {result.stderr!r}")
else:
    print("a usable GPU: the host-only refusals are not checked here", flush=True)

# Installed where they cannot collide with nccl-tests' binaries of the same names: in
# <libexecdir>/kolo, never in <bindir>.
introspect = run(["meson", "introspect", os.path.dirname(os.path.abspath(BENCH_DIR)),
                  "--installed"], timeout=60)
if introspect.returncode != 0:
    fail(f"meson introspect --installed: {introspect.stderr[-500:]}")
else:
    installed = json.loads(introspect.stdout).values()
    for program in FACTORS:
        places = [path for path in installed if os.path.basename(path) == program]
        # The folder is <libexecdir>/kolo whatever libexecdir was configured to.
        if len(places) != 1 or os.path.basename(os.path.dirname(places[0])) != "kolo" or \
                "/bin/" in places[0]:
            fail(f"{program} is installed at {places}, expected one <libexecdir>/kolo/{program}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("nccl-tests' command lines and output format: all checks passed")
