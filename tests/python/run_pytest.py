"""Runs one pytest file for Meson: exits 77 (Meson's "skipped") when this interpreter cannot
import what the file needs, saying why, and otherwise pytest's own status.
Usage: run_pytest.py TEST_FILE [MODULE...]; the modules are the imports to check."""

import importlib
import os
import sys

test_file, modules = sys.argv[1], sys.argv[2:]
for module in ["numpy", "pytest"] + modules:
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a broken installation
        print(f"SKIP: {sys.executable} cannot import {module} ({error}); install Debian's "
              f"python3-{module} (apt-get install python3-{module})", flush=True)
        sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main([test_file, "-v", "-p", "no:cacheprovider", "-rfE",
                      "--rootdir", os.path.dirname(os.path.abspath(test_file))]))
