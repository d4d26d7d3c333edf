"""One rank of a run of Horovod's PyTorch suite: runs pytest on the given tests and writes this
rank's results to REPORT_DIR/rank<R>.xml (JUnit XML). Started by run_suite.py under kolorun.

Usage: rank_pytest.py REPORT_DIR TEST_FILE [TEST_ID...]

Horovod's suite tells its launchers apart by their variables: with HOROVOD_RANK and HOROVOD_SIZE
set (as horovodrun exports them) it checks rank() and size() against them, shuts Horovod down
after every test and tests init() after shutdown(). They are set here from kolorun's KOLO_RANK and
KOLO_SIZE, so the suite runs as under horovodrun.
"""

import os
import sys

import pytest

report_dir, test_file, test_ids = sys.argv[1], sys.argv[2], sys.argv[3:]
rank = os.environ["KOLO_RANK"]
os.environ["HOROVOD_RANK"] = rank
os.environ["HOROVOD_SIZE"] = os.environ["KOLO_SIZE"]
selected = [f"{test_file}::{test_id}" for test_id in test_ids] or [test_file]
sys.exit(pytest.main(selected + ["-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                                 f"--junitxml={os.path.join(report_dir, f'rank{rank}.xml')}"]))
