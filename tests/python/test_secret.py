"""The job secret on the Python side: kolo.torch's object collectives (which unpickle what peers
send) refused in a job without a secret and working with one, under kolorun and torchrun; under
torchrun (kolo.init() and the torch.distributed backend) a KOLO_SECRET_FILE is what the ranks
prove, and neither it nor anything derived from it is in torch's store; without one, a generated
secret goes through torch's store with one warning, and the job counts as unauthenticated."""

import os

import pytest

import ranks
from kolo._port import free_port

SECRET = "0123456789abcdef-the-job-secret-in-a-file"


def _secret_file(directory, text=SECRET, name="kolo-secret"):
    path = os.path.join(str(directory), name)
    with open(path, "w") as file:
        file.write(text + "\n")
    os.chmod(path, 0o600)
    return path


def _torchrun(n):
    # As test_torch_ddp: Debian's torchrun needs --redirects 1 under Python 3.11.
    return [ranks.PYTHON, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
            "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port("127.0.0.1"))]


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


# ---- under torchrun ----------------------------------------------------------------------------

def _torch_store():
    from datetime import timedelta

    from torch.distributed import TCPStore
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=30))


def _has(store, key):
    """Whether torch's store holds key (torch 1.13's stores have no check()): waits a second."""
    from datetime import timedelta
    try:
        store.wait([key], timedelta(seconds=1))
    except RuntimeError:  # timed out
        return False
    return True


def _check_keys(store, prefix, expect_secret):
    """kolo's keys in torch's store: the address (which shows that this is where kolo's keys
    are), the secret's source, and the secret only when generated; no value holds the file's
    secret."""
    assert _has(store, prefix + "addr"), f"no {prefix}addr: the test looks in the wrong place"
    assert _has(store, prefix + "secret") == expect_secret, \
        f"{prefix}secret is {'absent' if expect_secret else 'readable in torch store'}"
    source = store.get(prefix + "secret_source").decode()
    assert source == ("store" if expect_secret else "ranks"), source
    for key in ("addr", "secret_source"):
        assert SECRET not in store.get(prefix + key).decode(), key


def _world_group_store():
    import torch.distributed as dist
    from torch.distributed import PrefixStore
    c10d = dist.distributed_c10d
    group = c10d._get_default_group()
    return group, PrefixStore(c10d._pg_names[group], c10d._get_default_store())


def rank_torchrun_with_a_secret_file():
    import torch
    import torch.distributed as dist
    import kolo
    import kolo.torch as hvd
    assert os.environ.get("KOLO_SECRET_FILE") and not os.environ.get("KOLO_SECRET")
    assert "TORCHELASTIC_RUN_ID" in os.environ and "KOLO_ADDR" not in os.environ
    hvd.init()  # kolo.init() under torchrun
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
    _check_keys(_torch_store(), "kolo/{}/{}/".format(os.environ["TORCHELASTIC_RUN_ID"],
                                                     os.environ["TORCHELASTIC_RESTART_COUNT"]),
                expect_secret=False)
    _objects_work(hvd)
    assert kolo.world().peers_authenticated and not kolo.world().secret_published
    # the torch.distributed backend, in the same job
    dist.init_process_group("kolo")
    group, store = _world_group_store()
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    assert t.item() == sum(range(dist.get_world_size())), t
    _check_keys(store, "kolo/", expect_secret=False)
    assert group._comm.peers_authenticated and not group._comm.secret_published
    dist.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


def rank_torchrun_with_different_secret_files(other_file):
    """The last rank proves another file's secret: had the launch path put a secret of its own
    over the files', the ranks would connect."""
    import kolo
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == size - 1:
        os.environ["KOLO_SECRET_FILE"] = other_file
    try:
        kolo.init()
    except kolo.KoloError as error:
        print(f"rank {rank} refused as expected: {error}", flush=True)
    else:
        raise AssertionError(f"rank {rank} joined although the last rank has another secret")


def rank_torchrun_without_a_secret():
    import warnings

    import torch
    import torch.distributed as dist
    import kolo
    import kolo.torch as hvd
    assert not os.environ.get("KOLO_SECRET_FILE") and not os.environ.get("KOLO_SECRET")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.init()
        dist.init_process_group("kolo")
    published = [w for w in caught if "torch's store" in str(w.message)]
    assert len(published) == 1, [str(w.message) for w in caught]
    assert issubclass(published[0].category, RuntimeWarning)
    for words in ("KOLO_SECRET_FILE", "not authenticated", "broadcast_object"):
        assert words in str(published[0].message), str(published[0].message)
    group, store = _world_group_store()
    _refusals(hvd, "torch's store")  # the job runs; only what unpickles is refused
    _check_keys(_torch_store(), "kolo/{}/{}/".format(os.environ["TORCHELASTIC_RUN_ID"],
                                                     os.environ["TORCHELASTIC_RESTART_COUNT"]),
                expect_secret=True)
    _check_keys(store, "kolo/", expect_secret=True)
    world = kolo.world()
    assert not world.peers_authenticated and world.secret_published
    assert not group._comm.peers_authenticated and group._comm.secret_published
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    dist.destroy_process_group()
    hvd.shutdown()


def test_secret_file_under_torchrun(tmp_path):
    ranks.run(2, __file__, "rank_torchrun_with_a_secret_file", launcher=_torchrun(2),
              env={"KOLO_SECRET": "", "KOLO_SECRET_FILE": _secret_file(tmp_path)})


def test_a_rank_with_another_secret_file_is_refused_under_torchrun(tmp_path):
    text = ranks.run(2, __file__, "rank_torchrun_with_different_secret_files",
                     launcher=_torchrun(2), timeout=60,
                     args={"other_file": _secret_file(tmp_path, "another secret", "other")},
                     env={"KOLO_SECRET": "", "KOLO_SECRET_FILE": _secret_file(tmp_path),
                          "KOLO_TIMEOUT": "10"})
    assert text.count("refused as expected") == 2, text


def test_no_secret_under_torchrun_warns_and_refuses_objects():
    ranks.run(2, __file__, "rank_torchrun_without_a_secret", launcher=_torchrun(2),
              env={"KOLO_SECRET": "", "KOLO_SECRET_FILE": ""})


# ---- the secret through torch's store, one rank at a time ------------------------------------

class _DictStore:
    """torch's store as far as kolo's launch paths use it."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]


@pytest.mark.parametrize("rank0_own, other_own", [(True, False), (False, True)])
def test_ranks_that_disagree_about_a_secret_are_told(monkeypatch, rank0_own, other_own):
    import kolo
    from kolo import _secret
    store = _DictStore()
    monkeypatch.delenv("KOLO_SECRET", raising=False)
    monkeypatch.delenv("KOLO_SECRET_FILE", raising=False)
    monkeypatch.setattr(_secret, "_warned_published", True)
    _secret.secret_through_torch_store(store, "p/", publisher=True, own_secret=rank0_own)
    with pytest.raises(kolo.ConfigError, match="set the same one on every rank"):
        _secret.secret_through_torch_store(store, "p/", publisher=False, own_secret=other_own)
    assert ("p/secret" in store.values) == (not rank0_own)


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
