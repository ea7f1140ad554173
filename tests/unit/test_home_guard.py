"""The guard that fails a test run which left something in HOME (tests/home_guard.py)."""

from __future__ import annotations

from pathlib import Path

from tests import home_guard


def test_manifest_sees_links_keys_and_changes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA operator\n")
    (home / ".cache" / "pip").mkdir(parents=True)
    before = {"HOME": home_guard.manifest(home, (".cache",))}

    (home / "kvroute").symlink_to(tmp_path)
    with (home / ".ssh" / "authorized_keys").open("a") as f:
        f.write("ssh-ed25519 BBBB kvroute-local\n")
    (home / ".kvroute").mkdir()
    (home / ".kvroute" / "redis.password").write_text("secret\n")
    (home / ".cache" / "pip" / "wheel").write_text("regenerable")  # a cache: not reported
    after = {"HOME": home_guard.manifest(home, (".cache",))}

    assert home_guard.differences(before, after) == [
        "HOME: added .kvroute (dir)",
        "HOME: added .kvroute/redis.password (file)",
        "HOME: added kvroute (link)",
        "HOME: changed .ssh/authorized_keys",
    ]


def test_an_untouched_tree_has_no_differences(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    (tmp_path / "l").symlink_to("a")
    snap = {"HOME": home_guard.manifest(tmp_path)}
    assert home_guard.differences(snap, {"HOME": home_guard.manifest(tmp_path)}) == []


def test_removal_is_reported(tmp_path: Path) -> None:
    (tmp_path / "gone").write_text("x")
    before = {"HOME": home_guard.manifest(tmp_path)}
    (tmp_path / "gone").unlink()
    assert home_guard.differences(before, {"HOME": home_guard.manifest(tmp_path)}) == [
        "HOME: removed gone (file)"
    ]
