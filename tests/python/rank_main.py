"""One rank of a Python test: imports a test module by path and runs one of its functions.
Usage: rank_main.py MODULE_FILE FUNCTION ARGS_JSON. A failure prints "RANK r FAILED" and the
traceback, and exits 1 (kolorun then stops the other ranks)."""

import importlib.util
import json
import os
import sys
import traceback

module_file, function, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rank = os.environ.get("KOLO_RANK", os.environ.get("RANK", "?"))
try:
    spec = importlib.util.spec_from_file_location("rank_module", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function)(**arguments)
except BaseException:
    sys.stdout.flush()
    print(f"RANK {rank} FAILED in {function}:\n{traceback.format_exc()}", flush=True)
    os._exit(1)
sys.stdout.flush()
sys.stderr.flush()
