"""A Ray token of the process's own for a local cluster that should leave nothing behind.

Ray 2.60 turns token authentication on for a new local cluster and, with no token anywhere,
writes one to ``~/.ray/auth_token``. The tests and the benchmarks that start a local cluster
take theirs from a file of their own instead (``RAY_AUTH_TOKEN_PATH``, inherited by every Ray
process and subprocess), removed at exit: authenticated as in production, and nothing left in
HOME. ``kvroute serve`` does not call this: an operator's local cluster keeps Ray's own token."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

_RAY_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def use_session_token(prefix: str = "kvroute-ray-") -> None:
    """Point ``RAY_AUTH_TOKEN_PATH`` at a new random token in a temporary directory (``prefix``
    names it), removed at exit; nothing where the environment already says how to
    authenticate."""
    if any(k in os.environ for k in _RAY_AUTH):
        return
    folder = tempfile.mkdtemp(prefix=prefix)
    path = Path(folder) / "auth_token"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    atexit.register(shutil.rmtree, folder, True)
