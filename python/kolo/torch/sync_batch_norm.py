"""SyncBatchNorm: batch normalisation whose statistics are those of the global batch (every
rank's samples), for CPU tensors."""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .ops import Sum, allreduce, global_process_set, _comm


class SyncBatchNorm(_BatchNorm):
    """A drop-in for torch.nn.BatchNorm1d/2d/3d (Horovod's SyncBatchNorm): in training, the mean
    and variance are computed over the samples of every rank of process_set, by one allreduce of
    (sum, sum of squares, count) per call; the gradient flows through that allreduce (its
    gradient is the allreduce of the gradient), so backward() on every rank is the gradient of
    the global batch. In evaluation, or on one rank, it is plain batch normalisation. Every rank
    calls forward the same number of times. Blocks in training."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or _comm(self.process_set).size == 1:
            return super().forward(input)
        if self.momentum is None:
            raise NotImplementedError("SyncBatchNorm needs a momentum (cumulative averages "
                                      "are not implemented)")
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() // input.shape[1]], dtype=input.dtype)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(local, op=Sum, process_set=self.process_set)
        c = self.num_features
        n = total[2 * c]
        mean = total[:c] / n
        variance = total[c:2 * c] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                unbiased = variance * (n / (n - 1)) if n > 1 else variance
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased)
        shape = [1, c] + [1] * (input.dim() - 2)
        output = (input - mean.view(shape)) / torch.sqrt(variance.view(shape) + self.eps)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output
