"""The project's user-facing exception types.

Errors a user can cause (a bad config, a malformed message, a bad task file) raise one of these, with a
message that names the field and says what is allowed. Anything else is a bug and should fail loudly.
"""


# The exit code of a role process (replay, learner, rollout) stopped by a ConfigError (sysexits' EX_CONFIG):
# `async-rl train` does not start such a role again, since it would stop on the same error.
CONFIG_EXIT_CODE = 78


class AsyncRLError(Exception):
    """Base of every error a user (or a peer process) can cause."""


class ConfigError(AsyncRLError):
    """The config file or a command-line override is wrong; the message names the dotted key."""


class ProtocolError(AsyncRLError):
    """A message on the wire could not be decoded or is not valid for this protocol version."""


class WeightsError(AsyncRLError, RuntimeError):
    """A weights file that cannot be written (a full disk), read or trusted (torn, or changed after it was written):
    the message names the file."""
