"""How fast a job under `kolorun --elastic --host-discovery-script` follows events, on this machine.

    python3 bench/elastic_driver_times.py [BUILD_DIR] [--ranks 4 8] [--repeats 5]

For each size N, each repeat starts N/2 ranks of tests/kolo_test_elastic_driver (an allreduce
every 10 ms, kolo_elastic_update every 5 steps) on the slots "localhost:N/2" and then measures:
  grow:  from the moment the discovery script's file names a second host "127.0.0.1:N/2" to the
         first allreduce of all N ranks (the latest rank's time; the worker prints it). The driver
         runs the script about once a second, so up to a second of this is the polling interval.
  loss:  from SIGKILL of one newcomer to the first allreduce of the N - 1 survivors after their
         kolo_comm_shrink (the latest rank's time).
Prints one line per repeat and the medians. The job secret and KOLO_TIMEOUT=30 are set here.
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def wait_for(path, pattern, count, timeout_s=120):
    """The matches of pattern in the file at path once there are count of them."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(path) as output:
            found = re.findall(pattern, output.read())
        if len(found) >= count:
            return found
        time.sleep(0.02)
    with open(path) as output:
        sys.exit(f"waited {timeout_s} s for {count} x {pattern!r}; the output:\n{output.read()}")


def write_hosts(directory, text):
    temporary = os.path.join(directory, "hosts.new")
    with open(temporary, "w") as hosts:
        hosts.write(text)
    os.rename(temporary, os.path.join(directory, "hosts"))


def one_run(build, size):
    half = size // 2
    with tempfile.TemporaryDirectory() as directory:
        write_hosts(directory, f"localhost:{half}\n")
        log = os.path.join(directory, "log")
        env = dict(os.environ, KOLO_SECRET="elastic-bench-secret-0123456789abcdef",
                   KOLO_TIMEOUT="30", KOLO_TRANSPORT=os.environ.get("KOLO_TRANSPORT", "tcp"))
        for name in ("KOLO_ADDR", "KOLO_RANK", "KOLO_SIZE", "KOLO_SECRET_FILE"):
            env.pop(name, None)
        command = [os.path.join(build, "src/kolorun"), "--elastic", "-np", str(half),
                   "--min-np", "1", "--max-np", str(size), "--host-discovery-script",
                   f"cat {directory}/hosts", os.path.join(build, "tests/kolo_test_elastic_driver"),
                   os.path.join(directory, "stop"), "5", "10"]
        with open(log, "w") as output:
            job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(log, rf"rank \d+ of {half} started", half)
            time.sleep(1)
            appeared = time.time()
            write_hosts(directory, f"localhost:{half}\n127.0.0.1:{half}\n")
            times = wait_for(log, rf"first allreduce of {size} ranks after the update at ([\d.]+)",
                             half)
            grow = max(float(t) for t in times) - appeared
            wait_for(log, rf"slot 127\.0\.0\.1:0: rank \d+ of {size} joined at step \d+, pid \d+", 1)
            with open(log) as output:
                pid = int(re.search(r"slot 127\.0\.0\.1:0: rank \d+ of \d+ joined at step \d+, "
                                    r"pid (\d+)", output.read()).group(1))
            time.sleep(0.5)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            times = wait_for(log, rf"first allreduce of {size - 1} ranks after the shrink at "
                             r"([\d.]+)", size - 1)
            loss = max(float(t) for t in times) - killed
        finally:
            open(os.path.join(directory, "stop"), "w").close()
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
    return grow, loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build", nargs="?", default="build")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("# ranks  repeat  grow_s  loss_s")
    summary = []
    for size in args.ranks:
        grows, losses = [], []
        for repeat in range(args.repeats):
            grow, loss = one_run(args.build, size)
            grows.append(grow)
            losses.append(loss)
            print(f"{size:7d}  {repeat:6d}  {grow:6.3f}  {loss:6.3f}", flush=True)
        summary.append((size, statistics.median(grows), statistics.median(losses)))
    for size, grow, loss in summary:
        print(f"# {size} ranks: median grow {grow:.3f} s (host appears -> first allreduce of all), "
              f"median loss {loss:.3f} s (SIGKILL -> first allreduce of the survivors)")


if __name__ == "__main__":
    main()
