"""kolo.torch.elastic's reaction times at N ranks: from a growth decided to the first training step
that includes the newcomers, and from a rank killed to the survivors' next step.

    PYTHONPATH=python:tests/python KOLO_LIBRARY=build/capi/libkolo.so \\
        /usr/bin/python3 bench/elastic_grow_perf.py [--sizes 4,8] [--rounds 3] [--tsv FILE]

Each round is one job of tests/python/test_torch_elastic_grow.py (the small regression network,
the test playing the launcher): N/2 ranks under `kolorun --elastic`; at rank 0's 2nd commit the
plan adds N/2 ranks (rank 0 writes the invitation, the launcher starts the newcomers with
KOLO_INVITATION); at step 8 the first newcomer kills itself with SIGKILL; the others go on at
N - 1. The job's final parameters are checked against the test's replay, as in the test.

  grow      the invitation written (the growth decided) -> the last rank of the N to end its first
            step at size N; of which: ready, the last newcomer ready to join (the launcher's
            poll, every 0.1 s, has seen the invitation and started it, and Python has imported
            torch and kolo), and joined, the last newcomer's hvd.init() returned
            (kolo_comm_init with the invitation: the growth connected);
  loss      the victim's last act before SIGKILL -> the last survivor to end its first step at
            N - 1 (the failed collective, shrink, restore, sync).
Times are wall-clock seconds of time.time() on one machine. Medians over the rounds are printed;
--tsv writes every round.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))

import test_torch_elastic_grow as job  # noqa: E402

KILL_STEP = 8


def one_round(n):
    with tempfile.TemporaryDirectory(prefix="kolo-elastic-perf-") as folder:
        folder = pathlib.Path(folder)
        half = n // 2
        status, newcomers, results, output = job._run_job(
            folder, half, {"2": {"join": n - half}}, kill_name="n2.0", kill_step=KILL_STEP)
        if status != 0 or any(s not in (0, -9) for s in newcomers.values()):
            raise SystemExit(f"the job failed ({status}, {newcomers}):\n{output[-4000:]}")
        job._check_against_replay(results, [f"m{r}" for r in range(half)] +
                                  [f"n2.{i}" for i in range(1, n - half)])
        invitation = json.loads((folder / "control" / "invitation-2.json").read_text())
        killed = float((folder / "out" / "kill").read_text())
        newcomer_results = [r for name, r in results.items() if name.startswith("n")]
        started = max(r["started"] for r in newcomer_results)
        joined = max(r["joined"] for r in newcomer_results)

        def first_step_at(size, after):
            times = []
            for r in results.values():
                at = [t for s, t in r["first_steps"] if s == size and t > after]
                times.append(min(at) if at else None)
            return max(t for t in times if t is not None)
        # The first newcomer died, so it has no results: the last first step at N is that of
        # the ranks still alive, which all stepped together with it.
        grown = first_step_at(n, invitation["time"])
        shrunk = first_step_at(n - 1, killed)
        return {"n": n, "grow_s": grown - invitation["time"],
                "start_s": started - invitation["time"], "join_s": joined - invitation["time"],
                "loss_s": shrunk - killed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tsv", help="write every round to this file")
    args = parser.parse_args()
    rows = []
    for round_index in range(args.rounds):
        for n in (int(s) for s in args.sizes.split(",")):
            row = one_round(n)
            row["round"] = round_index
            rows.append(row)
            print("round {round} N={n}: grow {grow_s:.3f} s (ready {start_s:.3f}, joined "
                  "{join_s:.3f}), loss {loss_s:.3f} s".format(**row), flush=True)
    print("| N | grow (decided -> first step at N) | of which newcomers ready | joined | "
          "ready -> first step | loss (kill -> next step) |")
    print("|--:|--:|--:|--:|--:|--:|")
    for n in sorted({r["n"] for r in rows}):
        mine = [r for r in rows if r["n"] == n]

        def median(key):
            return statistics.median(r[key] for r in mine)
        after_ready = statistics.median(r["grow_s"] - r["start_s"] for r in mine)
        print(f"| {n} | {median('grow_s'):.2f} s | {median('start_s'):.2f} s | "
              f"{median('join_s'):.2f} s | {after_ready * 1000:.0f} ms | "
              f"{median('loss_s') * 1000:.0f} ms |")
    if args.tsv:
        with open(args.tsv, "w") as file:
            keys = ["round", "n", "grow_s", "start_s", "join_s", "loss_s"]
            file.write("\t".join(keys) + "\n")
            for r in rows:
                file.write("\t".join(str(round(r[k], 4)) if isinstance(r[k], float) else
                                     str(r[k]) for k in keys) + "\n")


if __name__ == "__main__":
    main()
