"""deploy/native.py: which compiled files may run old code (what they import, by content), and
cleaning them. Every test but the first two and the last works in a temporary tree (``native.ROOT``
monkeypatched), with empty files standing for the extensions: nothing is compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import native

REPO = native.ROOT  # the real tree: ``tree`` below monkeypatches ``native.ROOT``

PYPROJECT = '[project]\nname = "x"\n\n[tool.mypy]\nstrict = true\n'


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A root holding MODULES' sources (empty), their packages' ``__init__.py``, a module none
    of them imports (``router/other.py``), one more (``cachemap/deep.py``) and a pyproject."""
    monkeypatch.setattr(native, "ROOT", tmp_path)
    sources = [native.source(m) for m in native.MODULES]
    sources += [p.parent / "__init__.py" for p in sources]
    sources += [tmp_path / "router" / "other.py", tmp_path / "cachemap" / "deep.py"]
    for path in sources:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    return tmp_path


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _build(root: Path) -> list[str]:
    """What a successful ``build`` leaves: the extensions, the runtime library and the record
    of what they were built from."""
    built = [native.extension(m) for m in native.MODULES] + [native.runtime_library()]
    for path in built:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"compiled")
    native._record(native.fingerprint())
    return sorted(str(p.relative_to(root)) for p in built)


def test_every_compiled_module_exists_in_the_repository() -> None:
    for m in native.MODULES:
        assert native.source(m).is_file(), m
        assert m.split(".")[0] in native.PACKAGES


def test_the_real_closure_holds_what_the_compiled_modules_import_and_not_the_cli() -> None:
    closure = native.closure()
    assert {str(native.source(m).relative_to(native.ROOT)) for m in native.MODULES} <= set(closure)
    # imported by router.core (TYPE_CHECKING or not), and the packages above the modules
    assert {"router/__init__.py", "router/placement.py", "engines/sim/__init__.py"} <= set(closure)
    # no compiled module imports the command line or the builder: editing them rebuilds nothing
    assert not {"deploy/cli.py", "deploy/native.py", "deploy/__init__.py"} & set(closure)
    # nor the workload generators and their flags, nor the commands
    assert not {"loadgen/synthetic.py", "loadgen/args.py", "deploy/commands/simulate.py"} & set(
        closure
    )
    assert all(p.split("/")[0] in native.PACKAGES for p in closure)


def test_nothing_built_is_missing_but_not_stale(tree: Path) -> None:
    assert native.stale() == []
    assert native.missing() == list(native.MODULES)


def test_a_fresh_build_is_neither(tree: Path) -> None:
    _build(tree)
    assert native.stale() == [] and native.missing() == [] and native.changes() == []


def test_an_edited_compiled_module_makes_every_compiled_file_stale(tree: Path) -> None:
    built = _build(tree)
    edited = _write(tree, str(native.source(native.MODULES[-1]).relative_to(tree)), "X = 1\n")
    # one build holds them all: each may call or inline the edited module's code
    assert sorted(native.stale()) == built
    assert native.changes() == [str(edited.relative_to(tree))]


def test_touching_or_rewriting_a_source_unchanged_is_not_stale(tree: Path) -> None:
    # what a `git checkout` of other branches and back, or a `touch`, does to the sources
    _build(tree)
    for path in tree.rglob("*.py"):
        path.write_bytes(path.read_bytes())
        os.utime(path, (4_000_000_000, 4_000_000_000))
    assert native.stale() == []


def test_an_edited_module_they_do_not_import_costs_no_rebuild(tree: Path) -> None:
    _build(tree)
    _write(tree, "router/other.py", "X = 2\n")
    _write(tree, "deploy/cli.py", "import router.core\n")  # imports them: not the other way
    assert native.stale() == [] and native.changes() == []


def test_an_edited_module_they_import_makes_them_stale_even_transitively(tree: Path) -> None:
    # compiled code bakes in the types and constants it imported
    _write(tree, "router/core.py", "from router import other\n")  # `other` is a module
    _write(tree, "router/other.py", "import cachemap.deep\n")
    built = _build(tree)
    _write(tree, "cachemap/deep.py", "LIMIT = 3\n")
    assert sorted(native.stale()) == built
    assert native.changes() == ["cachemap/deep.py"]


def test_a_package_above_a_compiled_module_is_in_the_closure(tree: Path) -> None:
    built = _build(tree)
    _write(tree, "engines/sim/__init__.py", "DEFAULT = 1\n")
    assert sorted(native.stale()) == built


def test_type_checking_function_level_and_relative_imports_count(tree: Path) -> None:
    # mypy reads all of them, so mypyc compiles against all of them
    _write(
        tree,
        "router/load.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.other import T\n",
    )
    _write(tree, "engines/bus/liveness.py", "def f():\n    from ..sim import extra\n")
    _write(tree, "engines/sim/extra.py", "")
    _write(tree, "cachemap/ingest.py", "import numpy\nimport json as j\nfrom . import deep\n")
    closure = set(native.closure())
    assert {"router/other.py", "engines/sim/extra.py", "cachemap/deep.py"} <= closure
    assert not {p for p in closure if p.startswith(("numpy", "json"))}
    built = _build(tree)
    _write(tree, "router/other.py", "class T: ...\n")
    assert sorted(native.stale()) == built


def test_a_source_that_does_not_parse_is_stale_not_an_error(tree: Path) -> None:
    built = _build(tree)
    _write(tree, "router/core.py", "def broken(:\n")
    assert sorted(native.stale()) == built


def test_a_changed_mypy_configuration_makes_them_stale(tree: Path) -> None:
    built = _build(tree)
    _write(tree, "pyproject.toml", PYPROJECT.replace('"x"', '"y"'))  # not mypy's: no matter
    assert native.stale() == []
    _write(tree, "pyproject.toml", PYPROJECT + "ignore_missing_imports = true\n")
    assert sorted(native.stale()) == built


def test_compiled_files_with_no_record_are_stale(tree: Path) -> None:
    # as an earlier build left them (it kept no record), or a removed build/ folder
    built = _build(tree)
    native.stamp().unlink()
    assert sorted(native.stale()) == built
    assert "no record" in native.changes()[0]


def test_a_compiled_file_replaced_after_the_build_is_stale(tree: Path) -> None:
    built = _build(tree)
    native.runtime_library().write_bytes(b"another build's runtime library")
    assert sorted(native.stale()) == built


def test_files_of_another_build_are_stale(tree: Path) -> None:
    _build(tree)
    stray = tree / "router" / f"other{native.SUFFIX}"  # not in MODULES
    stray.write_bytes(b"")
    assert native.stale() == [str(stray.relative_to(tree))]
    stray.unlink()
    # mypyc's default place for the runtime library, left by a build of another layout
    old = tree / f"abc__mypyc{native.SUFFIX}"
    old.write_bytes(b"")
    assert native.stale() == [old.name]


def test_clean_removes_every_compiled_file_the_record_and_no_source(tree: Path) -> None:
    _build(tree)
    (tree / "router" / f"other{native.SUFFIX}").write_bytes(b"")
    (tree / f"abc__mypyc{native.SUFFIX}").write_bytes(b"")
    native.clean()
    assert native.missing() == list(native.MODULES)
    assert not list(tree.rglob(f"*{native.SUFFIX}")) and not native.stamp().exists()
    assert all(native.source(m).exists() for m in native.MODULES)


def test_check_exits_1_naming_stale_files_and_what_changed(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = _build(tree)
    _write(tree, "router/core.py", "X = 1\n")
    assert native.main(["check"]) == 1
    out, err = capsys.readouterr()
    assert all(f"stale: {path}" in out for path in built)
    assert "router/core.py" in err
    native.clean()
    assert native.main(["check"]) == 0


def test_kvroute_warns_naming_what_changed(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _build(tree)
    native.warn_if_stale()
    assert capsys.readouterr().err == ""
    _write(tree, "router/load.py", "X = 1\n")
    native.warn_if_stale()
    err = capsys.readouterr().err
    assert f"{len(native.MODULES) + 1} compiled files may run old code" in err
    assert "router/load.py" in err and "make native" in err


def test_no_compiler_means_pure_python_not_an_error(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("shutil.which", lambda _cmd: None)
    assert "no C compiler" in (native.unavailable() or "")
    assert native.build(strict=True) is False  # strict is about code mypyc refuses, not this
    assert "running pure Python" in capsys.readouterr().err
    assert native.missing() == list(native.MODULES)


def test_warming_reaches_every_cache_map_kernel() -> None:
    """``build`` ends with ``cachemap.map.warm_kernels``, which fills numba's cache for what it
    calls: in a fresh process it must reach every ``@jit`` kernel, or a new kernel would
    compile at some process's first use after all (an ingress replica's first KV events)."""
    code = (
        "import json; from cachemap.jit import KERNELS; from cachemap.map import warm_kernels; "
        "print(json.dumps([warm_kernels(), [k.fn.__name__ for k in KERNELS]]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    warmed, every = json.loads(done.stdout.splitlines()[-1])
    assert warmed == every and len(every) >= 10
