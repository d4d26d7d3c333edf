"""The one helper of Horovod's runner that Horovod's test utilities import."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs target(*args) in a new thread (a daemon unless asked otherwise) and returns the
    started thread. silent: exceptions of target are swallowed instead of printed."""
    def body():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=body, name=name, daemon=daemon)
    thread.start()
    return thread
