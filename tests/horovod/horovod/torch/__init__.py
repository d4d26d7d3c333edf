"""horovod.torch answered by kolo.torch: every name kolo.torch exports, nothing of its own."""

from kolo.torch import *  # noqa: F401,F403
from kolo.torch import __all__  # noqa: F401
