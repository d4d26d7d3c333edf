"""Makes the package under python/ and the test helpers importable in the pytest process."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.join(os.path.dirname(os.path.dirname(_here)), "python"), _here):
    if path not in sys.path:
        sys.path.insert(0, path)
