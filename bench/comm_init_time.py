"""Times one kolo_comm_init (and kolo_comm_destroy) in this rank and prints
"rank R of N: kolo_comm_init S s"; bench/startup_mpirun.sh starts it on every rank.

Calls the C ABI through ctypes, so nothing but the call itself is inside the timing.
KOLO_LIBRARY names libkolo (default: libkolo.so.0 on the loader's path).
"""

import ctypes
import os
import sys
import time

library = ctypes.CDLL(os.environ.get("KOLO_LIBRARY", "libkolo.so.0"))
library.kolo_comm_last_error.restype = ctypes.c_char_p
comm = ctypes.c_void_p()
started = time.perf_counter()
status = library.kolo_comm_init(None, ctypes.byref(comm))
seconds = time.perf_counter() - started
if status != 0:
    sys.exit("kolo_comm_init failed: " + library.kolo_comm_last_error(None).decode())
rank, size = ctypes.c_int(), ctypes.c_int()
library.kolo_comm_rank(comm, ctypes.byref(rank))
library.kolo_comm_size(comm, ctypes.byref(size))
# One write, so that mpirun's forwarding cannot split the line from its end.
sys.stdout.write(f"rank {rank.value} of {size.value}: kolo_comm_init {seconds:.4f} s\n")
sys.stdout.flush()
library.kolo_comm_destroy(comm)
