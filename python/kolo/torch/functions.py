"""Horovod's helpers for starting training consistently: broadcast_parameters,
broadcast_optimizer_state, broadcast_object and allgather_object.

broadcast_object, allgather_object and broadcast_optimizer_state send Python objects as pickles,
and unpickling runs whatever code the sender put in them: they run only on a communicator whose
peers are authenticated by a job secret (Communicator.peers_authenticated: KOLO_SECRET,
KOLO_SECRET_FILE, or kolorun's), and otherwise raise ConfigError before sending or receiving
anything. broadcast_parameters moves tensors only and needs no secret."""

import io
import pickle

import numpy as np
import torch

from .._secret import require_authenticated_peers
from .ops import (_agree, _comm, _refuse_joined, _set_rank, broadcast_, broadcast_async_,
                  global_process_set, synchronize)


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Copies root_rank's parameters into every rank's, in place: params is a state_dict (its
    entries are taken sorted by name) or a list of (name, tensor) such as
    model.named_parameters(). Each tensor is broadcast by name, all at once, so ranks whose
    models differ get MismatchError naming the tensor. Blocks until done."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            raise ValueError("params must be a state_dict or a list of (name, tensor) pairs")
    handles = []
    for name, tensor in items:
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"parameter {name!r} is a {type(tensor).__name__}, not a tensor")
        handles.append(broadcast_async_(tensor, root_rank, name=f"broadcast.parameter.{name}",
                                        process_set=process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns root_rank's obj on every rank: pickled on the root, and the root's bytes
    unpickled on every other rank (tensors inside are pickled too). Unpickling runs any code the
    root chose, so the job needs a secret: without one (Communicator.peers_authenticated False)
    raises ConfigError on every rank before sending or receiving anything. Every rank calls it
    in the same order; obj is ignored except on the root. root_rank is a rank of the job (a
    member of process_set), as in Horovod. Blocks (an agreement, then two collectives: the
    length, then the bytes); ranks that disagree about the call get MismatchError, and the calls
    after it still work."""
    comm = _comm(process_set)
    require_authenticated_peers(comm, "broadcast_object")
    root_rank = _set_rank(process_set, root_rank)
    joined = _agree(comm, "broadcast", root=root_rank)
    if joined:
        _refuse_joined("broadcast_object", joined)
    if comm.rank == root_rank:
        buffer = io.BytesIO()
        pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
        payload = np.frombuffer(buffer.getvalue(), dtype=np.uint8).copy()
        length = np.array([payload.size], np.int64)
    else:
        length = np.zeros(1, np.int64)
    comm.broadcast_(length, root=root_rank)
    if comm.rank != root_rank:
        payload = np.empty(int(length[0]), np.uint8)
    comm.broadcast_(payload, root=root_rank)
    if comm.rank == root_rank:
        return obj
    return pickle.loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's obj, in rank order: each rank's obj pickled, and every
    other rank's bytes unpickled here. Unpickling runs any code the sender chose, so the job
    needs a secret: without one (Communicator.peers_authenticated False) raises ConfigError on
    every rank before sending or receiving anything. Blocks (an agreement, then two
    collectives)."""
    comm = _comm(process_set)
    require_authenticated_peers(comm, "allgather_object")
    joined = _agree(comm, "allgather", first_dim_free=True)
    if joined:
        _refuse_joined("allgather_object", joined)
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                            dtype=np.uint8).copy()
    gathered, lengths = comm.allgather_rows(payload)
    objects, offset = [], 0
    for length in lengths:
        objects.append(pickle.loads(gathered[offset:offset + length].tobytes()))
        offset += length
    return objects


def broadcast_optimizer_state(optimizer, root_rank, process_set=global_process_set):
    """Makes every rank's optimizer state (its state_dict: hyper-parameters of every parameter
    group and per-parameter state such as momentum buffers or Adam's moments) equal root_rank's.
    The structure and scalars (parameter groups, non-tensor state, the tensors' shapes and
    dtypes) travel pickled and are unpickled on every rank but the root, the state tensors by
    broadcast in place: the job needs a secret, and without one (Communicator
    .peers_authenticated False) raises ConfigError on every rank before sending or receiving
    anything. Every rank's optimizer must have the same parameter groups. As in Horovod, every
    parameter that requires a gradient and has none gets a zero gradient (parameters without
    requires_grad keep None). Unlike Horovod, an optimizer that has not stepped is not stepped
    once to make its state (which would count a step in Adam's bias correction): the root's
    state, empty or not, is what every rank gets. root_rank is a rank of the job. Blocks until
    done."""
    comm = _comm(process_set)
    require_authenticated_peers(comm, "broadcast_optimizer_state")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS keeps state that cannot be broadcast this way")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    state_dict = optimizer.state_dict()
    set_root = _set_rank(process_set, root_rank)
    if comm.rank == set_root:
        layout = {"param_groups": state_dict["param_groups"], "state": {}}
        for index, entries in state_dict["state"].items():
            layout["state"][index] = {
                key: ("tensor", tuple(value.shape), value.dtype)
                if isinstance(value, torch.Tensor) else ("value", value)
                for key, value in entries.items()}
    else:
        layout = None
    layout = broadcast_object(layout, root_rank, process_set=process_set)
    new_state = {}
    for index in sorted(layout["state"]):
        entries = {}
        for key in sorted(layout["state"][index]):
            kind = layout["state"][index][key]
            if kind[0] == "value":
                entries[key] = kind[1]
                continue
            if comm.rank == set_root:
                tensor = state_dict["state"][index][key].detach().contiguous().clone()
            else:
                tensor = torch.empty(kind[1], dtype=kind[2])
            broadcast_(tensor, root_rank, process_set=process_set)
            entries[key] = tensor
        new_state[index] = entries
    if comm.rank != set_root:
        optimizer.load_state_dict({"state": new_state, "param_groups": layout["param_groups"]})

