"""The job secret as the Python side sees it: whether a communicator's peers are authenticated,
the secret of the launch paths that meet through torch's store, and the refusal of the
collectives that unpickle what peers send.

kolo's core authenticates every connection with the job secret: the `secret` passed to
kolo_comm_init, else KOLO_SECRET, else the file named by KOLO_SECRET_FILE (src/core/config.cpp;
an empty variable counts as unset, an empty `secret` argument means no secret, and a file that
cannot be read fails kolo_comm_init). kolorun sets KOLO_SECRET for its ranks. The C ABI does not
report the secret, so a Communicator records at creation what it was given
(Communicator.peers_authenticated): True when it has a secret that only the job's ranks know.

Under torchrun (kolo.init()) and for the torch.distributed backend, the ranks meet through
torch's TCPStore, which anyone who reaches MASTER_ADDR:MASTER_PORT can read and write. When
KOLO_SECRET or KOLO_SECRET_FILE is set, the core reads it and nothing about it goes into that
store. When neither is set, rank 0 generates a secret and publishes it there, so that a plain
torchrun job still starts and a passer-by who does not speak torch's store protocol is still
kept out; but that secret is readable by anyone who reaches torch's port, so the communicator
counts as unauthenticated (a warning says so once per process) and the object collectives are
refused in it.
"""

import os
import secrets
import warnings

from .errors import ConfigError

SECRET_VARIABLES = ("KOLO_SECRET", "KOLO_SECRET_FILE")

# Keys in torch's store, under the launch path's prefix. SOURCE_KEY holds "ranks" when every rank
# brings its own secret (KOLO_SECRET, KOLO_SECRET_FILE or a `secret` argument), "store" when rank
# 0 published a generated one under SECRET_KEY: neither value says anything about the secret.
SOURCE_KEY = "secret_source"
SECRET_KEY = "secret"

_warned_published = False


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


def secret_through_torch_store(store, prefix, publisher, own_secret=False):
    """The secret argument for Communicator.create on a rank whose job meets through torch's
    store (`prefix` + the keys above), or None when the rank brings its own (KOLO_SECRET,
    KOLO_SECRET_FILE in the environment, or own_secret: a `secret` argument), which then never
    enters the store. Otherwise the publisher (rank 0) generates a secret and publishes it, every
    rank reads it, and this process warns once that the secret is readable by whoever reaches
    torch's store: pass secret_published=True with it. Blocks on the store (its timeout) until
    rank 0 has published. Raises ConfigError when this rank and rank 0 disagree about bringing
    their own secret (set KOLO_SECRET or KOLO_SECRET_FILE on every rank or on none)."""
    own = own_secret or environment_has_secret()
    if publisher:
        if not own:
            store.set(prefix + SECRET_KEY, secrets.token_hex(16))
        store.set(prefix + SOURCE_KEY, "ranks" if own else "store")
    source = store.get(prefix + SOURCE_KEY).decode()
    if own and source != "ranks":
        raise ConfigError("this rank has a job secret (KOLO_SECRET, KOLO_SECRET_FILE or a "
                          "`secret` argument) but rank 0 has none: set the same one on every "
                          "rank")
    if not own and source != "store":
        raise ConfigError("rank 0 has a job secret (KOLO_SECRET, KOLO_SECRET_FILE or a `secret` "
                          "argument) but this rank has none: set the same one on every rank")
    if own:
        return None
    _warn_published_once()
    return store.get(prefix + SECRET_KEY).decode()


def _warn_published_once():
    global _warned_published
    if _warned_published:
        return
    _warned_published = True
    warnings.warn("kolo: neither KOLO_SECRET nor KOLO_SECRET_FILE is set, so rank 0 generated "
                  "this job's secret and shared it through torch's store (MASTER_ADDR:"
                  "MASTER_PORT), which anyone who reaches that port can read: the job's peers "
                  "are not authenticated, and broadcast_object, allgather_object, "
                  "broadcast_optimizer_state and elastic state sync are refused. Set "
                  "KOLO_SECRET_FILE (or KOLO_SECRET) to the same secret on every rank.",
                  RuntimeWarning, stacklevel=3)


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
