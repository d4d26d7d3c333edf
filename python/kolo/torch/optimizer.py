"""DistributedOptimizer: Horovod's way of averaging gradients, on kolo's fusion engine.

A hook on every parameter's gradient accumulator submits the gradient by name (an in-place named
allreduce) as soon as backpropagation has accumulated it, counted down over
backward_passes_per_step; the engine fuses what every rank has submitted while backpropagation
goes on. synchronize() submits the gradients whose hook did not fire (parameters that got no
gradient, or whose requires_grad was turned off) and waits for all; step() synchronizes, unless
inside skip_synchronize(), then runs the wrapped optimizer's step.

Beyond Horovod: at construction every rank checks, with one collective, that all ranks have the
same parameter names, shapes, dtypes and requires_grad flags, and fails at once naming the first
difference and the ranks, instead of waiting forever in the first step.
"""

import contextlib
import hashlib
import itertools
import warnings
import weakref

import numpy as np
import torch

import kolo
from ._convert import KOLO_DTYPES
from .compression import Compression
from .functions import allgather_object
from .ops import (Average, Sum, _comm, _world, allreduce_async_, global_process_set,
                  sparse_allreduce_async, synchronize)


def _describe(name, parameter):
    return (name, tuple(parameter.shape), str(parameter.dtype), bool(parameter.requires_grad))


def _check_same_parameters(named, process_set):
    """One allgather of a digest of every rank's parameter list; on a difference, the lists
    themselves, to name the first difference and the ranks."""
    comm = _comm(process_set)
    descriptions = [_describe(name, p) for name, p in named]
    digest = np.frombuffer(hashlib.sha256(repr(descriptions).encode()).digest(),
                           dtype=np.uint8).copy()
    digests = comm.allgather(digest).reshape(comm.size, -1)
    if all(np.array_equal(digests[r], digests[0]) for r in range(comm.size)):
        return
    everyone = allgather_object(descriptions, process_set=process_set)

    def text(description):
        name, shape, dtype, requires_grad = description
        return f"'{name}' (shape {list(shape)}, {dtype}, requires_grad={requires_grad})"
    for r in range(1, comm.size):
        theirs, ours = everyone[r], everyone[0]
        if theirs == ours:
            continue
        for i in range(max(len(ours), len(theirs))):
            a = ours[i] if i < len(ours) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                differ = [q for q in range(comm.size)
                          if (everyone[q][i] if i < len(everyone[q]) else None) != a]
                raise kolo.MismatchError(
                    f"DistributedOptimizer: the ranks' models differ at parameter {i}: rank 0 "
                    f"has {text(a) if a else 'no parameter'} but rank {r} has "
                    f"{text(b) if b else 'no parameter'} (ranks that differ from rank 0 there: "
                    f"{differ}; rank 0 has {len(ours)} parameters, rank {r} {len(theirs)})")


# Every DistributedOptimizer alive, so that kolo.torch.shrink() can make them forget the requests
# they submitted on the world it replaces.
_optimizers = weakref.WeakSet()


_creation_order = itertools.count()


def _check_parameters_again():
    """After newcomers joined the world (kolo.torch.elastic), on the members: every
    DistributedOptimizer of the global process set checks its parameters again, in the order
    they were made, matching the check that each newcomer's DistributedOptimizer makes when the
    newcomer constructs it. A collective on the world."""
    for optimizer in sorted(_optimizers, key=lambda o: o._created):
        if optimizer._process_set is global_process_set:
            _check_same_parameters(optimizer._checked_parameters, global_process_set)


def _forget_pending_gradients():
    """Drops the pending gradient requests of every DistributedOptimizer (their communicator is
    being replaced; kolo fails them) and restarts their backward-pass counts."""
    for optimizer in list(_optimizers):
        optimizer._forget_pending()


class _SparseHandle:
    """The handle of a sparse gradient's reduction (sparse_allreduce_async's function)."""

    def __init__(self, finish):
        self._finish = finish
        self._value = None

    def poll(self):
        return True

    def wait(self):
        if self._value is None:
            self._value = self._finish()
        return self._value

    synchronize = wait


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods mixed into the wrapped optimizer's class (see DistributedOptimizer)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, sparse_as_dense=False):
        super(self.__class__, self).__init__(params)
        self._sparse_as_dense = sparse_as_dense
        self._compression = compression
        self._op = op
        self._gradient_predivide_factor = gradient_predivide_factor
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step

        all_parameters = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
                raise ValueError("named_parameters must be a sequence of (name, parameter) "
                                 "pairs, such as model.named_parameters()")
            names = [name for name, _ in named_parameters]
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"parameter names in named_parameters must be unique; "
                                 f"repeated: {duplicates}")
            named_ids = {id(p) for _, p in named_parameters}
            unnamed = [i for i, p in enumerate(all_parameters) if id(p) not in named_ids]
            if unnamed:
                raise ValueError(f"named_parameters was given, but the optimizer's parameters "
                                 f"at positions {unnamed} are not in it")
            owned = {id(p) for p in all_parameters}
            named_parameters = [(n, p) for n, p in named_parameters if id(p) in owned]
        else:
            named_parameters = [(f"allreduce.noname.{g}.{i}", p)
                                for g, group in enumerate(self.param_groups)
                                for i, p in enumerate(group["params"])]
        self._parameter_names = {p: name for name, p in named_parameters}
        if process_set.included():
            _check_same_parameters(named_parameters, process_set)
        self._checked_parameters = named_parameters
        self._created = next(_creation_order)

        self._requires_update = set()
        self._handles = {}
        self._grad_accumulators = []
        self._allreduce_delay = {p: backward_passes_per_step for _, p in named_parameters}
        self._should_synchronize = True
        self._synchronized = False
        self._fast_submit = None
        if process_set.included():
            prescale, postscale = 1.0, 1.0
            if op == Average and gradient_predivide_factor != 1.0:
                prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
            encoded = {p: name.encode() for p, name in self._parameter_names.items()}
            # The communicator is looked up at each submission: kolo.torch.shrink() replaces it.
            self._fast_submit = lambda p: (encoded[p], process_set.communicator(), prescale,
                                           postscale)
            self._register_hooks()
        _optimizers.add(self)

    def _forget_pending(self):
        self._handles.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = False

    def _register_hooks(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    # The gradient accumulator of p is where backpropagation adds into p.grad;
                    # its hook runs once p.grad holds this pass's contribution.
                    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                    accumulator.register_hook(self._make_hook(p))
                    self._grad_accumulators.append(accumulator)

    def _make_hook(self, p):
        def hook(*_):
            if p in self._handles and self._handles[p][0] is not None:
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "gradients were computed more than backward_passes_per_step times "
                        "before optimizer.step() or synchronize(); raise "
                        "backward_passes_per_step to accumulate gradients locally")
            handle, context = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                handle, context = self._submit(p)
            self._handles[p] = (handle, context)
        return hook

    def _submit(self, p):
        if p.grad is None:  # a parameter that took no part in this step: reduce zeros
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:  # an embedding's gradient (nn.Embedding(sparse=True))
            if not self._sparse_as_dense:
                return _SparseHandle(sparse_allreduce_async(
                    grad, self._parameter_names[p], self._op, self._process_set)), (grad, None)
            grad = grad.to_dense()
            handle = allreduce_async_(grad, name=self._parameter_names[p], op=self._op,
                                      process_set=self._process_set)
            return handle, (grad, None)
        if self._compression is Compression.none and self._fast_submit is not None and \
                grad.is_contiguous() and not grad.is_cuda and grad.dtype in KOLO_DTYPES:
            # The common case, once per gradient and step: straight to kolo, in place.
            name, comm, prescale, postscale = self._fast_submit(p)
            handle = comm.raw_allreduce_async(
                name, grad.data_ptr() or None, grad.data_ptr() or None, grad.numel(),
                KOLO_DTYPES[grad.dtype], self._op, prescale, postscale, keep=grad,
                result=grad)
            return handle, (grad, None)
        compressed, context = self._compression.compress(p.grad)
        prescale, postscale = 1.0, 1.0
        if self._op == Average and self._gradient_predivide_factor != 1.0:
            prescale = 1.0 / self._gradient_predivide_factor
            postscale = self._gradient_predivide_factor
        handle = allreduce_async_(compressed, name=self._parameter_names[p], op=self._op,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self._process_set)
        return handle, (compressed, context)

    def synchronize(self):
        """Submits the gradients not submitted yet (parameters without a gradient get zeros) and
        waits for all of them; afterwards every rank's p.grad holds the reduced gradient. Blocks
        (bounded by KOLO_TIMEOUT per tensor); raises the KoloError of a failed tensor."""
        if not self._process_set.included():
            self._synchronized = True
            return
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._submit(p)
        for p, (handle, context) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._submit(p)
        try:
            for p, (handle, (compressed, context)) in self._handles.items():
                output = synchronize(handle)
                self._allreduce_delay[p] = self.backward_passes_per_step
                if p.grad.is_sparse:  # the optimizer (SparseAdam, say) wants a sparse one back
                    p.grad = output if output.is_sparse else output.to_sparse()
                elif output is not p.grad:
                    with torch.no_grad():
                        p.grad.copy_(self._compression.decompress(output, context))
        finally:
            self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this context step() does not synchronize: for calling synchronize() yourself
        first, e.g. to clip the reduced gradients before the step."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """synchronize() (unless inside skip_synchronize()), then the wrapped optimizer's step.
        Blocks until the gradients are reduced."""
        if self._should_synchronize:
            if self._synchronized:
                # The sentence Horovod's warning opens with, for scripts and tests that match it
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): the gradients are "
                              "reduced twice. Use `with optimizer.skip_synchronize(): "
                              "optimizer.step()`.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        """The wrapped optimizer's zero_grad; refused while gradients are being reduced (between
        backward() and step()/synchronize()), which would race with the reduction."""
        if any(handle is not None for handle, _ in self._handles.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps a torch optimizer so that step() averages (op: Average or Sum) the gradients over
    the ranks of process_set first, as Horovod's DistributedOptimizer: returns a new optimizer of
    a subclass of optimizer's class, over the same parameter groups (its state starts empty).

    named_parameters (model.named_parameters()) names each gradient for kolo's engine (names
    must be unique and cover every parameter of the optimizer); compression
    (Compression.fp16) shrinks what is sent; backward_passes_per_step > 1 accumulates that many
    backward passes locally before reducing; gradient_predivide_factor divides before the sum
    and multiplies after it (Average only). Sparse gradients (nn.Embedding(sparse=True)) are
    reduced by sparse_allreduce_async (every rank's rows gathered), or, with sparse_as_dense, as
    dense tensors turned back into sparse ones for the step. Raises ValueError for bad arguments
    and, on every
    rank, MismatchError when the ranks' parameters differ (names, shapes, dtypes,
    requires_grad), naming the first difference and the ranks: a collective on process_set, so
    every rank constructs its DistributedOptimizer at the same point."""
    _world()
    if op not in (Average, Sum):
        raise ValueError("DistributedOptimizer reduces with op=Average or op=Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=Average")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be at least 1")
    if num_groups or groups is not None:
        raise NotImplementedError("num_groups and groups are not implemented in kolo.torch: "
                                  "kolo's engine fuses gradients by itself "
                                  "(KOLO_FUSION_THRESHOLD)")
    if compression not in (Compression.none, Compression.fp16) and \
            not hasattr(compression, "compress"):
        raise ValueError("compression must be Compression.none, Compression.fp16 or a "
                         "Compressor")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, process_set, sparse_as_dense)
