"""The test suite must leave the machine it runs on as it found it: no link, key or secret in the
home directory, no change to the SSH configuration. ``tests/conftest.py`` takes a manifest of both
before the session and compares it after; a difference fails the run and names every path.

What is compared: every entry under ``$HOME`` and ``/etc/ssh`` (its kind, mode, size, link target
and, for a file, modification time), not descending into ``$HOME/.cache``: the XDG cache directory
holds regenerable data by definition (pip's wheels, Hugging Face's, the built-in random models),
which a test may fill. ``KVROUTE_HOME_GUARD_IGNORE`` (colon-separated names relative to HOME) adds
entries to skip, e.g. a coding client's own state on a developer's machine.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

Manifest = dict[str, tuple[str, int, int, int, str]]

ALWAYS_IGNORED = (".cache",)


def ignored_names() -> tuple[str, ...]:
    extra = os.environ.get("KVROUTE_HOME_GUARD_IGNORE", "")
    return ALWAYS_IGNORED + tuple(n.strip("/") for n in extra.split(":") if n.strip("/"))


def manifest(root: Path, ignore: tuple[str, ...] = ()) -> Manifest:
    """Path (relative to ``root``) -> (kind, mode, size, mtime_ns, link target) for ``root`` and
    everything under it, links not followed, ``ignore`` (relative paths) skipped whole. Walked
    with ``os.scandir`` (a home with a Python and a Rust toolchain holds ~250k entries: 3 s,
    against 7 s through ``pathlib``)."""
    out: Manifest = {}
    top = os.fspath(root)
    skip = {os.path.join(top, name) for name in ignore}

    def record(rel: str, path: str, st: os.stat_result) -> bool:
        """Enter ``rel``; whether it is a directory to descend into."""
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", st.st_mode, 0, 0, os.readlink(path))
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", st.st_mode, 0, 0, "")
            return True
        else:
            out[rel] = ("file", st.st_mode, st.st_size, st.st_mtime_ns, "")
        return False

    try:
        if not record(".", top, os.lstat(top)):
            return out
    except FileNotFoundError:
        return out
    stack = [(top, "")]
    while stack:
        path, prefix = stack.pop()
        try:
            entries = os.scandir(path)
        except (PermissionError, FileNotFoundError):  # unreadable, or removed while walked
            continue
        with entries:
            for entry in entries:
                if entry.path in skip:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if record(prefix + entry.name, entry.path, st):
                    stack.append((entry.path, prefix + entry.name + "/"))
    return out


def roots() -> dict[str, tuple[Path, tuple[str, ...]]]:
    return {
        "HOME": (Path.home(), ignored_names()),
        "/etc/ssh": (Path("/etc/ssh"), ()),
    }


def snapshot() -> dict[str, Manifest]:
    return {name: manifest(root, ignore) for name, (root, ignore) in roots().items()}


def differences(before: dict[str, Manifest], after: dict[str, Manifest]) -> list[str]:
    """One line per path added, removed or changed, e.g. ``HOME: added .ssh/id_ed25519``."""
    lines: list[str] = []
    for name in sorted(before.keys() | after.keys()):
        b, a = before.get(name, {}), after.get(name, {})
        for rel in sorted(a.keys() - b.keys()):
            lines.append(f"{name}: added {rel} ({a[rel][0]})")
        for rel in sorted(b.keys() - a.keys()):
            lines.append(f"{name}: removed {rel} ({b[rel][0]})")
        for rel in sorted(a.keys() & b.keys()):
            if a[rel] != b[rel]:
                lines.append(f"{name}: changed {rel}")
    return lines
