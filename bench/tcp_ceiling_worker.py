"""One rank of bench/tcp_ceiling.sh: times ITERATIONS out-of-place float32 sum allreduces of BYTES
through kolo (whichever libkolo KOLO_LIBRARY names) and the CPU time this process spent in them,
checks every element of the last result, and prints one line:

    rank R: busbw MEDIAN BEST GB/s cpu USER SYS s sent GB

busbw is 2(N-1)/N * BYTES / time (the rate at which this rank sends, as tcp_loopback reports),
cpu the user and system seconds of getrusage over the timed calls, sent the bytes this rank sent
in them (10^9 bytes).

    python3 bench/tcp_ceiling_worker.py BYTES ITERATIONS WARMUP
"""
import resource
import sys
import time

import numpy as np

import kolo


def main():
    nbytes, iterations, warmup = (int(value) for value in sys.argv[1:4])
    comm = kolo.init()
    rank, size = comm.rank, comm.size
    count = nbytes // 4
    send = np.full(count, rank + 1, dtype=np.float32)
    recv = np.zeros(count, dtype=np.float32)
    dtype = kolo.communicator.kolo_dtype_of(send)
    for _ in range(warmup):
        comm.raw_allreduce(send.ctypes.data, recv.ctypes.data, count, dtype, kolo.SUM)
    comm.barrier()
    seconds = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(iterations):
        start = time.perf_counter()
        comm.raw_allreduce(send.ctypes.data, recv.ctypes.data, count, dtype, kolo.SUM)
        seconds.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    expected = size * (size + 1) / 2
    wrong = int(np.count_nonzero(recv != expected))
    if wrong:
        print(f"rank {rank}: {wrong} of {count} elements wrong (expected {expected})", flush=True)
        sys.exit(1)
    seconds.sort()
    per_call = 2 * (size - 1) / size * count * 4
    print(f"rank {rank}: busbw {per_call / seconds[len(seconds) // 2] * 1e-9:.3f} "
          f"{per_call / seconds[0] * 1e-9:.3f} GB/s "
          f"cpu {after.ru_utime - before.ru_utime:.3f} {after.ru_stime - before.ru_stime:.3f} s "
          f"sent {per_call * iterations * 1e-9:.4f} GB", flush=True)
    comm.barrier()
    kolo.shutdown()


if __name__ == "__main__":
    main()
