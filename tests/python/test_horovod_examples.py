"""The scripts of examples/horovod/ (Horovod's published PyTorch examples with only the import
changed: the synthetic benchmark, MNIST-style training on scikit-learn's digits, the elastic
example) run under kolorun at N = 1, 2 and 4 with small settings, and do what they say: the
benchmark reports img/sec per rank, training reaches a test accuracy, the elastic example goes on
with 3 ranks after one of 4 is killed from outside."""

import os
import re
import signal
import subprocess
import time

import pytest

import ranks

EXAMPLES = os.path.join(ranks.CHECKOUT, "examples", "horovod")


def _run(n, script, *arguments, elastic=False, timeout=300):
    command = [ranks.kolorun_path(), "-np", str(n), "--timeout", str(timeout)] + \
        (["--elastic"] if elastic else []) + [ranks.PYTHON, os.path.join(EXAMPLES, script)] + \
        list(arguments)
    status, output = ranks.run_command(command, timeout + 30)
    assert status == 0, f"{' '.join(command)} exited with {status}:\n{output[-4000:]}"
    return output


def _accuracy(output):
    found = re.findall(r"Accuracy: ([0-9.]+)%", output)
    assert found, output[-3000:]
    return float(found[-1])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_synthetic_benchmark(n):
    output = _run(n, "pytorch_synthetic_benchmark.py", "--batch-size", "8",
                  "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2")
    assert f"Number of CPUs: {n}" in output, output[-3000:]
    assert len(re.findall(r"Iter #\d+: [0-9.]+ img/sec per CPU", output)) == 2, output[-3000:]
    assert re.search(rf"Total img/sec on {n} CPU\(s\): [0-9.]+ \+-[0-9.]+", output), \
        output[-3000:]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mnist_style_training_learns(n):
    output = _run(n, "pytorch_mnist.py", "--epochs", "4")
    assert output.count("Test set:") == 4, output[-3000:]
    assert _accuracy(output) > 80.0, output[-3000:]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_elastic_example_learns(n):
    output = _run(n, "pytorch_mnist_elastic.py", "--epochs", "3", elastic=True)
    assert f"epoch 2: {n} ranks" in output, output[-3000:]
    assert _accuracy(output) > 80.0, output[-3000:]


def _rank_pid(kolorun_pid, rank):
    """The pid of the process kolorun started as rank `rank` (its KOLO_RANK)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            if parent != kolorun_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if f"KOLO_RANK={rank}".encode() in environ.read().split(b"\0"):
                    return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    return None


def test_elastic_example_goes_on_when_a_rank_is_killed():
    command = [ranks.kolorun_path(), "-np", "4", "--timeout", "300", "--elastic", ranks.PYTHON,
               os.path.join(EXAMPLES, "pytorch_mnist_elastic.py"), "--epochs", "4",
               "--log-interval", "2"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=ranks.test_environment(), start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 300
        killed = False
        for line in job.stdout:
            lines.append(line)
            if not killed and "Train Epoch: 1" in line:
                victim = _rank_pid(job.pid, 3)
                assert victim is not None, "rank 3's process was not found"
                os.kill(victim, signal.SIGKILL)
                killed = True
            assert time.monotonic() < deadline, "the job ran past 300 s"
        status = job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = "".join(lines)
    assert killed, output[-3000:]
    assert status == 0, f"exit status {status}:\n{output[-4000:]}"
    assert "epoch 3: 3 ranks" in output, output[-4000:]
    assert _accuracy(output) > 80.0, output[-3000:]
