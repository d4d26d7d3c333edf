"""Starting N rank processes for a test: each runs one function of a test module under kolorun,
and the test fails, naming the ranks that failed and showing their output, when any rank fails
or the job runs past its time limit. Every process started is killed before run() returns.

Rank functions are plain module-level functions (named rank_*, so pytest does not collect them)
that raise on failure; `args` reach them as keyword arguments (JSON)."""

import json
import os
import re
import signal
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(os.path.dirname(HERE))
PYTHON = "/usr/bin/python3"  # Debian's interpreter, which sees python3-numpy and python3-torch


def kolorun_path():
    """kolorun from KOLORUN (set by Meson), else the checkout's build tree."""
    return os.environ.get("KOLORUN") or os.path.join(CHECKOUT, "build", "src", "kolorun")


def test_environment(extra=None):
    """The environment of a rank: PYTHONPATH at python/ and the tests, KOLO_LIBRARY kept."""
    env = dict(os.environ)
    paths = [os.path.join(CHECKOUT, "python"), HERE]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("KOLO_TIMEOUT", "60")
    env["OMP_NUM_THREADS"] = "1"
    if extra:
        env.update(extra)
    return env


def run(n, module_file, function, timeout=120, env=None, args=None, expect_failure=False,
        launcher=None, kolorun_options=()):
    """Runs function(**args) of module_file on n ranks with kolorun (with kolorun_options, such
    as "--elastic"), or with launcher, a command that starts a Python script on every rank (such
    as torchrun), and returns their combined output. Raises AssertionError naming the failing
    ranks (or the timeout) unless expect_failure, in which case it returns (exit status,
    output)."""
    rank_command = [os.path.join(HERE, "rank_main.py"), os.path.abspath(module_file), function,
                    json.dumps(args or {})]
    if launcher:  # a launcher that runs a Python script itself (torchrun)
        command = launcher + rank_command
    else:
        command = [kolorun_path(), "-np", str(n), "--timeout", str(timeout), "--grace", "3",
                   *kolorun_options, PYTHON] + rank_command
    status, text = run_command(command, timeout, env)
    if expect_failure:
        return status, text
    if status != 0:
        failed = sorted(set(int(r) for r in re.findall(r"RANK (\d+) FAILED", text)))
        who = f"ranks {failed} failed" if failed else "no rank reported a failure"
        if status == "timeout" or status == 124:
            who += f"; the job ran past {timeout} s and was killed"
        raise AssertionError(f"{function} on {n} ranks: {who} (exit status {status}); "
                             f"output:\n{text[-6000:]}")
    return text


def run_command(command, timeout, env=None):
    """Runs a job's command in a process group of its own; returns (exit status or "timeout",
    output). Kills the whole group afterwards, whatever happened."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=test_environment(env), start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout + 20)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = "timeout"
    finally:
        try:  # nothing this test started may outlive it
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return status, output.decode(errors="replace")
