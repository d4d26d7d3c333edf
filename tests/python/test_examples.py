"""The scripts of examples/ run as the README shows them (shortened to a few epochs), under
kolorun and under torchrun, and learn: the digits classifier reaches 85% test accuracy. And the
port their launchers are given is one that no other job takes first."""

import os
import re
import socket

import ranks
from kolo._port import free_port

EXAMPLES = os.path.join(ranks.CHECKOUT, "examples")


def _kolorun(n):
    return [ranks.kolorun_path(), "-np", str(n), "--timeout", "240", ranks.PYTHON]


def _torchrun(n):
    return [ranks.PYTHON, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
            "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port("127.0.0.1"))]


def _run(command, env=None):
    status, output = ranks.run_command(command, timeout=240, env=env)
    assert status == 0, f"{' '.join(command)} exited with {status}:\n{output[-4000:]}"
    return output


def _final_accuracy(output):
    found = re.findall(r"test accuracy ([0-9.]+)", output)
    assert found, output[-2000:]
    return float(found[-1])


def test_numpy_example():
    output = _run(_kolorun(4) + [os.path.join(EXAMPLES, "numpy_allreduce.py")])
    assert output.count("sum of ranks [6. 6. 6. 6.]") == 4, output
    assert output.count("KOLO_ERR_MISMATCH: ranks disagree about tensor 'bad'") == 4, output


def test_horovod_style_example_under_kolorun():
    output = _run(_kolorun(2) + [os.path.join(EXAMPLES, "pytorch_digits.py"), "--epochs", "4"])
    assert "done: 2 ranks" in output and _final_accuracy(output) > 0.85, output[-2000:]


def test_horovod_style_example_under_torchrun(tmp_path):
    # broadcast_optimizer_state unpickles: the job needs a secret of its own, as the README says
    secret = tmp_path / "kolo-secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    output = _run(_torchrun(2) + [os.path.join(EXAMPLES, "pytorch_digits.py"), "--epochs", "4"],
                  env={"KOLO_SECRET": "", "KOLO_SECRET_FILE": str(secret)})
    assert "done: 2 ranks" in output and _final_accuracy(output) > 0.85, output[-2000:]


def test_horovod_style_example_under_torchrun_c10d(tmp_path):
    """With the c10d rendezvous (every multi-node torchrun, and --standalone) torchrun serves no
    store at MASTER_PORT: kolo.init() meets in kolo's own store at MASTER_PORT + 1 instead of
    waiting for one there (docs/several-hosts.md)."""
    secret = tmp_path / "kolo-secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    command = [ranks.PYTHON, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
               "--nproc_per_node", "2", "--nnodes", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{free_port('127.0.0.1')}",
               os.path.join(EXAMPLES, "pytorch_digits.py"), "--epochs", "2"]
    output = _run(command, env={"KOLO_SECRET": "", "KOLO_SECRET_FILE": str(secret)})
    digests = re.findall(r"rank (\d): parameters sha256 ([0-9a-f]{64})", output)
    assert sorted(rank for rank, _ in digests) == ["0", "1"], output[-2000:]
    assert len({digest for _, digest in digests}) == 1, output[-2000:]


def test_ddp_example_under_torchrun():
    output = _run(_torchrun(2) + [os.path.join(EXAMPLES, "ddp_digits.py"), "--epochs", "4"])
    assert _final_accuracy(output) > 0.85, output[-2000:]


def test_benchmark_runs():
    """bench/python_step_perf.py on small gradients: all three methods run and are reported."""
    output = _run(_kolorun(2) + [os.path.join(ranks.CHECKOUT, "bench", "python_step_perf.py"),
                                 "--model", "resnet50", "--steps", "1", "--warmup", "0",
                                 "--max-tensor-bytes", "64K"])
    for method in ("local", "kolo-hooks", "ddp-gloo", "ddp-kolo"):
        assert method in output, output


def test_store_port_is_free_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral_low = int(ports.read().split()[0])
    picked = {free_port("127.0.0.1") for _ in range(20)}
    assert all(10000 <= port < ephemeral_low for port in picked), picked
    assert len(picked) > 10, picked
    for port in picked:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # still free
