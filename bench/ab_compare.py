#!/usr/bin/python3
"""Two builds of kolo side by side: runs one benchmark command for build A, then for build B,
round after round (so that both see the same spells of a shared machine), and prints the median
of every time in the benchmark's table with the ratio B / A (above 1: B is slower), and in how
many rounds B was the faster: a sign test, since a real difference wins most rounds whatever the
load, where noise splits them.

    /usr/bin/python3 bench/ab_compare.py --rounds 5 /tmp/kolo-base/build build -- \\
        {build}/src/kolorun -np 2 {build}/bench/all_reduce_perf -b 8 -e 256M -f 4 -n 20

{build} in the command stands for each build folder; a leading NAME=value sets the environment.
Reads the tables of all_reduce_perf (time out of place and in place, per size) and fusion_perf
(fused, unfused and ordered ms, per model). Standard library only."""

import argparse
import os
import re
import statistics
import subprocess
import sys

NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def parse(text):
    """{(row, column): time} from a benchmark's output (rank 0's lines, "[0] " stripped)."""
    times = {}
    for line in text.splitlines():
        line = re.sub(r"^\[\d+\]\s?", "", line)
        if line.lstrip().startswith("#"):
            continue
        if "|" in line:  # fusion_perf: model ... | fused ms ... | unfused ... | ordered [| bound]
            parts = [p.split() for p in line.split("|")]
            if len(parts) >= 5 and parts[0] and len(parts[1]) >= 1 and NUMBER.match(parts[1][0]):
                model = parts[0][0]
                times[(model, "fused ms")] = float(parts[1][0])
                times[(model, "unfused ms")] = float(parts[2][0])
                if parts[4] and NUMBER.match(parts[4][0]):
                    times[(model, "ordered ms")] = float(parts[4][0])
                if len(parts) >= 6 and parts[5] and NUMBER.match(parts[5][0]):  # --bound
                    times[(model, "bound ms")] = float(parts[5][0])
            continue
        fields = line.split()
        # all_reduce_perf: size count type redop root time algbw busbw #wrong time algbw busbw #wrong
        if len(fields) == 13 and fields[0].isdigit() and NUMBER.match(fields[5]):
            times[(int(fields[0]), "out-of-place us")] = float(fields[5])
            times[(int(fields[0]), "in-place us")] = float(fields[9])
    return times


def run(template, build, timeout):
    command = [word.replace("{build}", build) for word in template]
    env = dict(os.environ)
    while command and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[0]):
        name, value = command.pop(0).split("=", 1)
        env[name] = value
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        sys.exit(f"ab_compare: {' '.join(command)} exited with {done.returncode}:\n"
                 f"{done.stdout[-3000:]}")
    times = parse(done.stdout)
    if not times:
        sys.exit(f"ab_compare: no table in the output of {' '.join(command)}:\n{done.stdout[-3000:]}")
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="build folder A (the reference)")
    parser.add_argument("b", help="build folder B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("command", nargs="+", help="the benchmark command, after --")
    args = parser.parse_args()
    samples = {"a": {}, "b": {}}
    for round_ in range(args.rounds):
        for side in ("a", "b"):
            for key, value in run(args.command, getattr(args, side), args.timeout).items():
                samples[side].setdefault(key, []).append(value)
        print(f"# round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"# {' '.join(args.command)}")
    print(f"# A = {args.a}, B = {args.b}, {args.rounds} alternating rounds, medians")
    print("| row | column | A | B | B / A | rounds B faster |")
    print("|---|---|--:|--:|--:|--:|")
    for key in sorted(samples["a"], key=lambda k: (str(type(k[0])), k[0], k[1])):
        if key not in samples["b"]:
            continue
        a_runs, b_runs = samples["a"][key], samples["b"][key]
        a, b = statistics.median(a_runs), statistics.median(b_runs)
        ratio = f"{b / a:.2f}" if a > 0 else "-"
        faster = sum(1 for x, y in zip(a_runs, b_runs) if y < x)
        print(f"| {key[0]} | {key[1]} | {a:g} | {b:g} | {ratio} | {faster} of "
              f"{min(len(a_runs), len(b_runs))} |")


if __name__ == "__main__":
    main()
