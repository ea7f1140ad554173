"""deploy/native.py: which compiled files may run old code, and cleaning them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy import native


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A root holding MODULES' sources and one other source (empty files) for ``native``."""
    monkeypatch.setattr(native, "ROOT", tmp_path)
    for path in [native.source(m) for m in native.MODULES] + [tmp_path / "router" / "other.py"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        os.utime(path, (1_000, 1_000))
    return tmp_path


def _touch(path: Path, mtime: float) -> Path:
    path.write_bytes(b"")
    os.utime(path, (mtime, mtime))
    return path


def _build(root: Path, mtime: float) -> list[str]:
    built = [_touch(native.extension(m), mtime) for m in native.MODULES]
    native.runtime_library().parent.mkdir(parents=True, exist_ok=True)
    built.append(_touch(native.runtime_library(), mtime))
    return sorted(str(p.relative_to(root)) for p in built)


def test_every_compiled_module_exists_in_the_repository() -> None:
    for m in native.MODULES:
        assert native.source(m).is_file(), m
        assert m.split(".")[0] in native.PACKAGES


def test_nothing_built_is_missing_but_not_stale(tree: Path) -> None:
    assert native.stale() == []
    assert native.missing() == list(native.MODULES)


def test_a_fresh_build_is_neither(tree: Path) -> None:
    _build(tree, 2_000)
    assert native.stale() == [] and native.missing() == []


def test_an_edited_compiled_module_makes_every_compiled_file_stale(tree: Path) -> None:
    built = _build(tree, 2_000)
    os.utime(native.source(native.MODULES[-1]), (3_000, 3_000))
    # one build holds them all: each may call or inline the edited module's code
    assert sorted(native.stale()) == built


def test_an_edited_module_they_import_makes_them_stale_too(tree: Path) -> None:
    # compiled code bakes in the types and constants it imported
    built = _build(tree, 2_000)
    os.utime(tree / "router" / "other.py", (3_000, 3_000))
    assert sorted(native.stale()) == built


def test_files_of_another_build_are_stale(tree: Path) -> None:
    _build(tree, 2_000)
    stray = _touch(tree / "router" / f"other{native.SUFFIX}", 2_000)  # not in MODULES
    assert native.stale() == [str(stray.relative_to(tree))]
    stray.unlink()
    # mypyc's default place for the runtime library, left by a build of another layout
    old = _touch(tree / f"abc__mypyc{native.SUFFIX}", 2_000)
    assert native.stale() == [old.name]


def test_clean_removes_every_compiled_file_and_no_source(tree: Path) -> None:
    _build(tree, 2_000)
    _touch(tree / "router" / f"other{native.SUFFIX}", 2_000)
    _touch(tree / f"abc__mypyc{native.SUFFIX}", 2_000)
    native.clean()
    assert native.missing() == list(native.MODULES)
    assert not list(tree.rglob(f"*{native.SUFFIX}"))
    assert all(native.source(m).exists() for m in native.MODULES)


def test_check_exits_1_naming_stale_files(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = _build(tree, 500)  # older than the sources
    assert native.main(["check"]) == 1
    out = capsys.readouterr().out
    assert all(f"stale: {path}" in out for path in built)
    native.clean()
    assert native.main(["check"]) == 0


def test_no_compiler_means_pure_python_not_an_error(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("shutil.which", lambda _cmd: None)
    assert "no C compiler" in (native.unavailable() or "")
    assert native.build(strict=True) is False  # strict is about code mypyc refuses, not this
    assert "running pure Python" in capsys.readouterr().err
    assert native.missing() == list(native.MODULES)
