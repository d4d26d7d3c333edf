"""kolo on numpy arrays: a blocking allreduce, named asynchronous ones, and an error.

    build/src/kolorun -np 4 /usr/bin/python3 examples/numpy_allreduce.py

(PYTHONPATH=python from the checkout.)
"""

import numpy as np

import kolo

kolo.init()
rank, size = kolo.rank(), kolo.size()

total = kolo.allreduce(np.full(4, rank, dtype=np.float32), op=kolo.SUM)
print(f"rank {rank}: sum of ranks {total}")

# Named operations may be submitted in any order on each rank; kolo fuses them.
names = [f"grad.{i}" for i in range(8)]
order = names if rank % 2 == 0 else names[::-1]
gradients = {name: np.full(1000, rank + i, dtype=np.float32) for i, name in enumerate(names)}
handles = {name: kolo.allreduce_async_(gradients[name], name=name, op=kolo.AVG)
           for name in order}
for name in names:
    kolo.synchronize(handles[name])
print(f"rank {rank}: grad.0 averaged to {gradients['grad.0'][0]}, "
      f"fusion {kolo.fusion_stats()['collectives']} collective(s) for 8 tensors")

# Ranks that disagree get an exception naming the tensor and the ranks, on every rank.
try:
    kolo.allreduce_async(np.zeros(10 + (rank == size - 1), np.float32), name="bad").wait()
except kolo.MismatchError as error:
    print(f"rank {rank}: {error}")

kolo.shutdown()
