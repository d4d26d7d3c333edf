"""The job secret on the Python side: kolo.torch's object collectives (which unpickle what peers
send) refused in a job without a secret and working with one."""

import os

import pytest

import ranks

SECRET = "0123456789abcdef-the-job-secret-in-a-file"


def _secret_file(directory, text=SECRET, name="kolo-secret"):
    path = os.path.join(str(directory), name)
    with open(path, "w") as file:
        file.write(text + "\n")
    os.chmod(path, 0o600)
    return path


def _expect_refused(call, function, why):
    """call() raises ConfigError naming `function`, why the peers are unauthenticated, and how
    to set a secret."""
    import kolo
    with pytest.raises(kolo.ConfigError) as raised:
        call()
    text = str(raised.value)
    for words in (f"{function} refused", "unpickles", "unauthenticated", why, "KOLO_SECRET,",
                  "KOLO_SECRET_FILE", "kolorun"):
        assert words in text, f"{function}: expected {words!r} in the error, got: {text}"


def _refusals(hvd, why):
    """Every object collective refused, on this rank alone and in an order of its own: had any
    of them sent or received a byte, the ordered calls that follow would disagree."""
    import torch
    from kolo.torch import elastic
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = [
        (lambda: hvd.broadcast_object({"a": 1}, root_rank=0), "broadcast_object"),
        (lambda: hvd.allgather_object(hvd.rank()), "allgather_object"),
        (lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0),
         "broadcast_optimizer_state"),
        (lambda: elastic.ObjectState(epoch=1).sync(), "ObjectState.sync"),
        (lambda: elastic.TorchState(model, optimizer, epoch=1).sync(), "TorchState.sync"),
        (lambda: elastic.run(lambda state: None)(elastic.ObjectState(epoch=1)),
         "ObjectState.sync"),
    ]
    me = hvd.rank()
    for call, function in calls[me % len(calls):] + calls[:me % len(calls)]:
        _expect_refused(call, function, why)
    # a process set's communicator is no more authenticated than the world it was split from
    everyone = hvd.add_process_set(list(range(hvd.size())))
    _expect_refused(lambda: hvd.allgather_object(me, process_set=everyone), "allgather_object",
                    why)
    # what moves tensors only still works, and the ordered stream is intact
    torch.manual_seed(me)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    weights = hvd.allgather(model.weight.detach().reshape(1, -1))
    assert all(torch.equal(row, weights[0]) for row in weights), weights
    total = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum)
    assert total.item() == sum(range(hvd.size())), total


def _objects_work(hvd):
    import torch
    n, me = hvd.size(), hvd.rank()
    assert hvd.broadcast_object({"from": me}, root_rank=n - 1) == {"from": n - 1}
    assert hvd.allgather_object(me) == list(range(n))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.param_groups[0]["lr"] == 0.1


# ---- under kolorun ---------------------------------------------------------------------------

def rank_objects_without_a_secret():
    os.environ.pop("KOLO_SECRET")  # kolorun's: this job has none
    import kolo
    import kolo.torch as hvd
    hvd.init()
    _refusals(hvd, "it has no job secret")
    assert not kolo.world().peers_authenticated and not kolo.world().secret_published
    hvd.shutdown()


def rank_objects_with_a_secret(secret_file):
    import kolo
    import kolo.torch as hvd
    if secret_file:  # the same secret from a file instead of kolorun's variable
        os.environ.pop("KOLO_SECRET")
        os.environ["KOLO_SECRET_FILE"] = secret_file
    hvd.init()
    _objects_work(hvd)
    assert kolo.world().peers_authenticated
    hvd.shutdown()


@pytest.mark.parametrize("n", [1, 3])
def test_object_collectives_refused_without_a_secret(n):
    ranks.run(n, __file__, "rank_objects_without_a_secret")


@pytest.mark.parametrize("from_file", [False, True])
def test_object_collectives_work_with_a_secret(tmp_path, from_file):
    ranks.run(2, __file__, "rank_objects_with_a_secret",
              args={"secret_file": _secret_file(tmp_path) if from_file else None})


def test_what_counts_as_a_secret(monkeypatch):
    from kolo import _secret
    monkeypatch.delenv("KOLO_SECRET", raising=False)
    monkeypatch.delenv("KOLO_SECRET_FILE", raising=False)
    assert not _secret.secret_is_authenticating(None)
    assert _secret.secret_is_authenticating("s") and _secret.secret_is_authenticating(b"s")
    monkeypatch.setenv("KOLO_SECRET", "")  # empty: unset, as the core reads it
    assert not _secret.secret_is_authenticating(None)
    monkeypatch.setenv("KOLO_SECRET_FILE", "/some/file")
    assert _secret.secret_is_authenticating(None)
    assert not _secret.secret_is_authenticating("")  # an empty argument wins over the file
