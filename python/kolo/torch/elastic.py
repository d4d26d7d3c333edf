"""Horovod's elastic training on kolo: when a rank is lost, the others go on from the state they
last committed, on a world of the survivors; when the launcher adds ranks, they join at a commit
and get the committed state; when it removes a rank's slot, that rank leaves at a commit.

    import kolo.torch as hvd
    from kolo.torch import elastic

    hvd.init()
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def scale_learning_rate():                   # a reset callback: the size has changed
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()
    state.register_reset_callbacks([scale_learning_rate])

    @elastic.run
    def train(state):
        while state.epoch < epochs:
            for batch_idx, (x, y) in enumerate(loader):
                ...                              # forward, backward, optimizer.step()
                sampler.record_batch(batch_idx, 32)
                state.batch += 1
                if state.batch % 10 == 0:
                    state.commit()               # at the same step on every rank
            state.epoch, state.batch = state.epoch + 1, 0
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)

What happens when a rank dies: the collectives of the others fail with PeerLostError (at once, as
its connections close) or KoloTimeoutError (a rank that hangs, after KOLO_TIMEOUT). run() catches
those two, and only those: it calls kolo.torch.shrink() (kolo_comm_shrink: the survivors agree on
a new world, ranked in their old order), state.restore() (back to the last commit), the reset
callbacks, state.sync() (every rank takes rank 0's state) and calls the function again. The
sampler then shares the samples that the committed model has not seen over the new number of
ranks. What was computed after the last commit is computed again, by the survivors: commit as
often as that is worth, and at the same step on every rank (a commit copies the state dicts,
cheap for a small model, and under kolorun's driver asks it for updates: one small collective).

sync() sends the state as pickles (broadcast_object, allgather_object,
broadcast_optimizer_state), and unpickling runs whatever code the sender put in them: the job
needs a secret (KOLO_SECRET, KOLO_SECRET_FILE, or kolorun's), and without one sync(), and so
run(), raise ConfigError before sending anything.

Growing and removing ranks (`kolorun --elastic` with a host discovery script): commit() saves and
then calls check_host_updates(), a collective in which rank 0 asks the launcher's driver whether
slots were added or removed (kolo_elastic_update; without the driver, KOLO_ELASTIC_ADDR unset,
nothing is sent). On a change:
  - a rank whose slot was removed shuts kolo down and raises SystemExit(0): the process leaves
    run() and exits with status 0 (a `finally:` around train(state) still runs, the code after
    it does not), and the launcher counts that as a graceful leave;
  - every other rank takes the new world (the ranks that stay, in their old order, then the
    newcomers), as shrink() does, and check_host_updates() raises HostsUpdatedInterrupt; run()
    catches it and, with no restore (the state was just committed), calls the reset callbacks,
    state.sync() (rank 0's committed model, optimizer, samplers and values to every rank,
    newcomers included) and the function again. The samplers then share the epoch's samples not
    yet processed over the new number of ranks.
A newcomer is started by the launcher with KOLO_INVITATION: hvd.init() joins the growth, and
run()'s first sync() gives it the state. Between the two it may make no collective but the
construction of its DistributedOptimizers, whose parameter check the members repeat when
newcomers join (in the order the optimizers were made). If the growth fails (a newcomer that dies while joining,
a driver out of reach), check_host_updates() raises the PeerLostError or KoloTimeoutError of
kolo_elastic_update, and run() resets as after a loss: shrink() (the members that are alive,
without the newcomers), restore() (the commit just made), callbacks, sync().
"""

import copy
import functools
import logging
import math

import torch

import kolo

from .._secret import require_authenticated_peers
from ..errors import KoloTimeoutError, PeerLostError
from . import ops
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, \
    broadcast_parameters
from .ops import _comm, global_process_set, rank, shrink, size

_log = logging.getLogger("kolo.torch.elastic")


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by check_host_updates() (and so by commit()) on the ranks that stay when ranks
    joined or left: the world has already been replaced. run() catches it and synchronises the
    state to the new world. Attributes: joined, left, old_size, new_size."""

    def __init__(self, joined, left, old_size, new_size):
        super().__init__(f"the world changed from {old_size} to {new_size} ranks ({joined} "
                         f"joined, {left} left)")
        self.joined, self.left, self.old_size, self.new_size = joined, left, old_size, new_size
        self.skip_sync = False  # Horovod's attribute: newcomers always need the state here


def _driver_update(world):
    """Asks `kolorun --elastic`'s driver (Communicator.elastic_update)."""
    return world.elastic_update()


# Where check_host_updates() learns of a change: a function of the world communicator, called
# by every rank at the same point, that returns (ElasticUpdate, new world or None) as
# Communicator.elastic_update does. Tests replace it to play the launcher themselves.
_update_source = _driver_update


def check_host_updates():
    """The collective of State.check_host_updates(): applies the launcher's decision about this
    job's slots (see the module's docstring). Returns None when nothing changed; raises
    SystemExit(0) on a leaving rank (after kolo.torch.shutdown()), HostsUpdatedInterrupt on
    the others when the world changed, and the KoloError of a growth that failed (the world
    then stays, broken: run() shrinks it)."""
    world = kolo.world()
    update, new_world = _update_source(world)
    if not update.changed:
        return
    if update.leaving:
        _log.info("rank %d of %d: the launcher removed this rank's slot; leaving", world.rank,
                  world.size)
        ops.shutdown()
        raise SystemExit(0)
    if new_world is None:
        raise kolo.InternalError("check_host_updates: the world changed but no new "
                                 "communicator came back")
    _adopt_world(new_world, newcomers=update.joined > 0)
    _log.info("rank %d: the world changed from %d to %d ranks (%d joined, %d left)",
              new_world.rank, update.old_size, update.new_size, update.joined, update.left)
    raise HostsUpdatedInterrupt(update.joined, update.left, update.old_size, update.new_size)


def _adopt_world(new_world, newcomers):
    """Makes new_world the world of kolo and kolo.torch, as shrink() does with the survivors:
    pending gradients forgotten, process sets other than the global one removed, nodes counted
    again (an allgather on new_world, which newcomers make in init()). With newcomers, every
    DistributedOptimizer checks its parameters again, as the newcomers' constructors do (so a
    newcomer makes, between init() and run(), exactly the collectives of its
    DistributedOptimizers)."""
    from .optimizer import _check_parameters_again, _forget_pending_gradients
    _forget_pending_gradients()
    kolo._adopt_world(new_world)
    for process_set in list(ops._process_sets.values()):
        if process_set is not global_process_set:
            ops.remove_process_set(process_set)
    ops._bind_world(new_world)
    if newcomers:
        _check_parameters_again()


def run(func=None, *, reset_limit=None):
    """Decorator: func(state, *args, **kwargs) is called after state.sync(), and called again
    after each change of the world, as described in the module's docstring; returns what func
    returns. Use it as @run or @run(reset_limit=n). A PeerLostError or KoloTimeoutError (from
    func, or from the shrink, restore and sync of a reset) starts a reset after a loss; after
    reset_limit of those (default: the world's size when the function is called) the next one
    is raised. A HostsUpdatedInterrupt (ranks joined or left at a commit) starts a reset without
    restore, and is not counted. A leaving rank's SystemExit(0) goes through. Every other
    exception propagates at once, with no reset. Blocks as func does; a reset blocks while the
    survivors agree (at most about three times KOLO_TIMEOUT) and for the broadcasts of sync()."""
    if func is None:
        return functools.partial(run, reset_limit=reset_limit)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        limit = size() if reset_limit is None else reset_limit
        resets = 0
        lost_ranks = hosts_updated = False
        while True:
            try:
                if lost_ranks:
                    shrink()
                    state.restore()
                    state.on_reset()
                elif hosts_updated:
                    state.on_reset()
                lost_ranks = hosts_updated = False
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                hosts_updated = True
                _log.info("rank %d of %d: %s; synchronising the committed state", rank(),
                          size(), interrupt)
            except (PeerLostError, KoloTimeoutError) as error:
                if resets >= limit:
                    raise
                resets += 1
                lost_ranks = True
                _log.warning("rank %d of %d: %s; shrinking the world and restoring the last "
                             "commit (reset %d of at most %d)", rank(), size(), error, resets,
                             limit)
    return wrapper


class State:
    """The base of the states that run() restores and synchronises: reset callbacks and
    commit(). A subclass defines save(), restore() and sync()."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Adds callables (no arguments) that on_reset() calls, in order, after each loss of
        ranks and each change of the world at a commit (not on a newcomer's first sync): where
        the learning rate and whatever else depends on the number of ranks is adjusted
        (hvd.size() is the new size there)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Calls the reset callbacks; run() does it after shrinking the world and restoring, or
        after ranks joined or left, before sync()."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Keeps a copy of the state (save()) for restore() to return to, then calls
        check_host_updates(). Every rank must commit at the same step: after a loss of ranks the
        survivors restart from their commits, which must describe the same training, and
        check_host_updates() is a collective under `kolorun --elastic`. The copy is local;
        check_host_updates() sends nothing without the launcher's driver."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Applies the launcher's decision about this job's slots (the module-level
        check_host_updates()): returns when nothing changed, raises HostsUpdatedInterrupt when
        ranks joined or left (run() synchronises the state to the new world), SystemExit(0) on
        a rank whose slot was removed. A collective on the world under `kolorun --elastic`;
        without its driver (KOLO_ELASTIC_ADDR unset) it returns at once."""
        check_host_updates()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """A state of picklable Python values, given as keyword arguments and kept as attributes
    (state.epoch = 3). commit() deep-copies them, restore() puts the copies back, sync() gives
    every rank rank 0's values (one broadcast_object) and commits them."""

    def __init__(self, **kwargs):
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved = {}
        self.save()

    def save(self):
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self):
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self):
        """Blocks for one broadcast_object from rank 0 on the world: the values are unpickled,
        so a job without a secret gets ConfigError."""
        _require_authenticated_peers("ObjectState.sync")
        values = broadcast_object({name: getattr(self, name) for name in self._names},
                                  root_rank=0)
        for name, value in values.items():
            setattr(self, name, value)
        self.save()


class TorchState(ObjectState):
    """The state of a PyTorch training: a model, an optimizer (a DistributedOptimizer or any
    torch optimizer), ElasticSamplers and other values, all given as keyword arguments and kept as
    attributes (state.model, state.optimizer, state.epoch, ...). commit() copies the model's and
    optimizer's state dicts, each sampler's progress and the other values; restore() loads the
    copies back into the same objects; sync() broadcasts rank 0's parameters and buffers,
    optimizer state and values, takes the union of the ranks' sampler progress, re-shards each
    sampler over the current world, and commits. Construction commits once (no communication)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        self._samplers = {name: value for name, value in kwargs.items()
                          if isinstance(value, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._saved_model = self._saved_optimizer = None
        self._saved_samplers = {}
        super().__init__(**{name: value for name, value in kwargs.items()
                            if name not in self._samplers})

    def save(self):
        super().save()
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        self._saved_samplers = {name: sampler.state_dict()
                                for name, sampler in self._samplers.items()}

    def restore(self):
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)  # it copies what it loads
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])

    def sync(self):
        """Blocks for the broadcasts and allgathers on the world. The optimizer state, the
        samplers' progress and the values are unpickled: a job without a secret gets
        ConfigError, before anything is sent."""
        _require_authenticated_peers("TorchState.sync")
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for sampler in self._samplers.values():
            sampler._sync()
        super().sync()  # the other values, then save() of everything


def _require_authenticated_peers(function):
    require_authenticated_peers(_comm(global_process_set), function)


def _rank_and_size():
    return rank(), size()


class ElasticSampler(torch.utils.data.Sampler):
    """A torch Sampler that shares out the samples of an epoch not yet processed over the ranks
    of the current world, so that a job whose world shrinks or grows in the middle of an epoch
    finishes it on the new world with every sample processed once.

    Each epoch's order is a permutation of range(len(dataset)) seeded by seed + epoch (or the
    natural order when shuffle is False), the same on every rank. reset() (at construction,
    set_epoch() and after each change of the world, through TorchState.sync) takes the indices of
    that order not recorded as processed, pads them by repeating from their start to a multiple of
    the number of ranks, and gives rank r every size-th one from position r: len(sampler) is the
    same on every rank, and the padding (fewer than size indices) is the only repetition. The
    shards stay fixed until the next reset(), whatever is recorded meanwhile.

    Record progress with record_batch() after each step; TorchState commits and restores it
    (state_dict(), load_state_dict()) and sync() takes the union of the survivors' records."""

    def __init__(self, dataset, shuffle=True, seed=0):
        super().__init__(dataset)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch `epoch`: nothing processed yet, a new order, re-sharded."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Records batch batch_idx (batch_size indices per rank, counted from the start of
        this sampler's iteration since its last reset) as processed by every rank: ranks step
        together, so this rank records the others' shares of the batch too, and a batch that a
        lost rank had processed before the commit is not processed again."""
        start, stop = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for shard in range(self.num_replicas):
            self.processed_indices.update(self._padded[shard::self.num_replicas][start:stop])

    def record_indices(self, indices):
        """Records dataset indices as processed by this rank only: after a loss of ranks, what
        only a lost rank recorded is processed again."""
        self.processed_indices.update(int(index) for index in indices)

    def state_dict(self):
        """The epoch and the indices processed in it (a dict of plain values)."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict):
        """Puts back what state_dict() returned, and re-shards."""
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self):
        """Re-shards the indices not processed in this epoch over the current world's ranks
        (kolo.torch.rank(), size()). Does not communicate."""
        self.rank, self.num_replicas = _rank_and_size()
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        repeats = math.ceil(total / len(self.remaining_indices)) if self.remaining_indices else 0
        self._padded = (self.remaining_indices * repeats)[:total]
        self.indices = self._padded[self.rank::self.num_replicas]

    def _sync(self):
        """Every rank takes rank 0's epoch and the union of the records made in it, then
        re-shards: one allgather_object on the world."""
        everyone = allgather_object((self.epoch, sorted(self.processed_indices)))
        epoch = everyone[0][0]
        processed = set()
        for their_epoch, their_indices in everyone:
            if their_epoch == epoch:
                processed.update(their_indices)
        self.epoch, self.processed_indices = epoch, processed
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
