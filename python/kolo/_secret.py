"""The job secret as the Python side sees it: whether a communicator's peers are authenticated,
and the refusal of the collectives that unpickle what peers send.

kolo's core authenticates every connection with the job secret: the `secret` passed to
kolo_comm_init, else KOLO_SECRET, else the file named by KOLO_SECRET_FILE (src/core/config.cpp;
an empty variable counts as unset, an empty `secret` argument means no secret, and a file that
cannot be read fails kolo_comm_init). kolorun sets KOLO_SECRET for its ranks. The C ABI does not
report the secret, so a Communicator records at creation what it was given
(Communicator.peers_authenticated): True when it has a secret that only the job's ranks know.
"""

import os

from .errors import ConfigError

SECRET_VARIABLES = ("KOLO_SECRET", "KOLO_SECRET_FILE")


def environment_has_secret(environ=None):
    """True when the core will take the job secret from KOLO_SECRET or KOLO_SECRET_FILE (set and
    not empty, as the core reads them)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name) for name in SECRET_VARIABLES)


def secret_is_authenticating(secret):
    """Whether a communicator created with `secret` (None: from the environment) has a secret:
    the core uses a given secret, even an empty one, before the environment."""
    if secret is not None:
        return len(secret) > 0
    return environment_has_secret()


def require_authenticated_peers(comm, function):
    """Raises ConfigError, before anything is sent or received, when `function` (which unpickles
    what peers send, and so runs whatever code a peer chooses) is called on a communicator whose
    peers are not authenticated."""
    if comm.peers_authenticated:
        return
    why = ("its secret was shared through torch's store, which anyone who reaches "
           "MASTER_ADDR:MASTER_PORT can read" if comm.secret_published
           else "it has no job secret")
    raise ConfigError(f"{function} refused: it unpickles what other ranks send, which runs any "
                      f"code they choose, and this job's peers are unauthenticated ({why}). Set "
                      f"a job secret on every rank: KOLO_SECRET, or KOLO_SECRET_FILE naming a "
                      f"file readable by its owner only, or start the job with kolorun, which "
                      f"generates one")
