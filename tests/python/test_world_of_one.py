"""A Python process started alone, with no launcher's variable in its environment, is a world of
one: kolo.init() and kolo.torch's init() give rank 0 of 1, and a collective returns the input, as
`python train.py` does under Horovod; a size without a rank is still refused."""

import os
import subprocess
import sys

import pytest

SCRIPT_NUMPY = """
import numpy, kolo
world = kolo.init()
assert (kolo.rank(), kolo.size(), kolo.local_rank(), kolo.local_size()) == (0, 1, 0, 1)
data = numpy.array([1.5, -2.0, 3.25], dtype=numpy.float32)
assert numpy.array_equal(world.allreduce(data), data)
print("numpy world", kolo.rank(), kolo.size())
kolo.shutdown()
"""

SCRIPT_TORCH = """
import torch
import kolo.torch as hvd
hvd.init()
assert (hvd.rank(), hvd.size()) == (0, 1)
tensor = torch.tensor([1.0, 2.0, 4.0])
assert torch.equal(hvd.allreduce(tensor, op=hvd.Sum), tensor)
print("torch world", hvd.rank(), hvd.size())
hvd.shutdown()
"""


def _alone(script, **extra):
    # Only what Python needs to find kolo: no launcher variable of the test's own environment (a
    # CI job under Slurm, say) reaches the child.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ["PYTHONPATH"],
           "KOLO_LIBRARY": os.environ["KOLO_LIBRARY"], "KOLO_TRANSPORT": "tcp",
           "KOLO_DEBUG": "INFO"}
    env.update(extra)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)


def test_numpy_world_of_one():
    result = _alone(SCRIPT_NUMPY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "numpy world 0 1"
    assert result.stderr.count("this process is a world of one") == 1, result.stderr


def test_torch_world_of_one():
    pytest.importorskip("torch")
    result = _alone(SCRIPT_TORCH)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch world 0 1"
    assert result.stderr.count("this process is a world of one") == 1, result.stderr


def test_size_without_rank_is_refused():
    result = _alone(SCRIPT_NUMPY, KOLO_SIZE="2")
    assert result.returncode != 0
    assert "ConfigError" in result.stderr, result.stderr
    assert "KOLO_SIZE=2" in result.stderr and "KOLO_RANK" in result.stderr, result.stderr
