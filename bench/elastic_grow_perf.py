"""kolo.torch.elastic's reaction times at N ranks: from a growth decided to the first training step
that includes the newcomers, and from a rank killed to the survivors' next step.

    KOLO_TRANSPORT=tcp PYTHONPATH=python:tests/python KOLO_LIBRARY=build/capi/libkolo.so \\
        /usr/bin/python3 bench/elastic_grow_perf.py [--sizes 4,8] [--rounds 3] \\
        [--launcher driver|harness] [--tsv FILE]

Each round is one job of tests/python/test_torch_elastic_grow.py (the small regression network,
3 epochs), started with N/2 ranks and grown to N before step 4; at step 8 a newcomer kills itself
with SIGKILL and the others go on at N - 1. --launcher driver (the default): under `kolorun
--elastic --host-discovery-script`, rank 0 rewrites the script's file from localhost:N/2 to
localhost:N and the ranks commit until the driver has added the newcomers (it restarts the killed
slot later). --launcher harness: the test plays the launcher (at rank 0's 2nd commit the plan adds
N/2 ranks, the test starts them from the invitation file, polling every 0.1 s). The final
parameters are checked against the test's replay.

  grow      rank 0's check_host_updates() call that grew the world began (the plan asked for) ->
            the last rank of the N to end its first step at size N; of which: ready, the last
            newcomer ready to join (started by the launcher, Python having imported torch and
            kolo), and joined, the last newcomer's hvd.init() returned (kolo_comm_init with the
            invitation: the growth connected);
  loss      the victim's last act before SIGKILL -> the last survivor to end its first step at
            N - 1 (the failed collective, shrink, restore, sync).
Times are wall-clock seconds of time.time() on one machine. Medians over the rounds are printed;
--tsv writes every round.
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))

import test_torch_elastic_grow as job  # noqa: E402

KILL_STEP = 8
# The members wait in the growth, up to KOLO_TIMEOUT, for newcomers that start Python and import
# torch: on a busy 2-core machine 4 of them took more than the tests' 10 s.
KOLO_TIMEOUT = 60


def one_round(n, launcher):
    with tempfile.TemporaryDirectory(prefix="kolo-elastic-perf-") as folder:
        folder = pathlib.Path(folder)
        half = n // 2
        if launcher == "driver":
            victim, first_rank = f"localhost:{n - 1}", "localhost:0"
            status, output, results, out_dir = job._run_under_driver(
                folder, half, n, f"localhost:{half}\n", kill_name=victim, kill_step=KILL_STEP,
                waits=[[4, n, f"localhost:{n}\n"]], kolo_timeout=KOLO_TIMEOUT)
            newcomer_statuses = {}
        else:
            victim, first_rank, out_dir = "n2.0", "m0", folder / "out"
            status, newcomer_statuses, results, output = job._run_job(
                folder, half, {"2": {"join": n - half}}, kill_name=victim, kill_step=KILL_STEP,
                kolo_timeout=KOLO_TIMEOUT)
        if status != 0 or any(s not in (0, -9) for s in newcomer_statuses.values()):
            raise SystemExit(f"the job failed ({status}, {newcomer_statuses}):\n"
                             f"{output[-4000:]}")
        try:
            job._check_against_replay(results, sorted(results))
        except AssertionError as error:
            raise SystemExit(f"{error}; the job's output:\n{output[-6000:]}") from None
        killed = float((out_dir / "kill").read_text())
        decided = min(began for began, size in results[first_rank]["updates"] if size == n)
        # The ranks of the grown world that lived through the kill (a slot the driver restarts
        # after it does not count).
        grown = [r for r in results.values() if r["started"] < killed]
        newcomers = [r for r in grown if r["started"] > decided]

        def last_first_step(size, after):
            return max(min(t for s, t in r["first_steps"] if s == size and t > after)
                       for r in grown)
        return {"n": n, "launcher": launcher,
                "grow_s": last_first_step(n, decided) - decided,
                "start_s": max(r["started"] for r in newcomers) - decided,
                "join_s": max(r["joined"] for r in newcomers) - decided,
                "loss_s": last_first_step(n - 1, killed) - killed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launcher", choices=["driver", "harness"], default="driver",
                        help="kolorun's driver (the discovery script's file grows from N/2 to N "
                        "slots), or the test playing the launcher")
    parser.add_argument("--tsv", help="write every round to this file")
    args = parser.parse_args()
    rows = []
    for round_index in range(args.rounds):
        for n in (int(s) for s in args.sizes.split(",")):
            row = one_round(n, args.launcher)
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
            keys = ["round", "launcher", "n", "grow_s", "start_s", "join_s", "loss_s"]
            file.write("\t".join(keys) + "\n")
            for r in rows:
                file.write("\t".join(str(round(r[k], 4)) if isinstance(r[k], float) else
                                     str(r[k]) for k in keys) + "\n")


if __name__ == "__main__":
    main()
