"""The hot pure-Python modules, compiled to C extensions with mypyc (mypy's compiler).

The cluster simulator spends its time in the sim engines' scheduler and block manager, the
router core's load tracking and scorer, and KV-event translation: typed Python that mypyc
compiles as it stands, with the same results (every figure of ``kvroute simulate --json``
identical). The simulator runs ~1.6x faster compiled (``benchmarks/sim_bench.py``, kv_ttft on
the shared trace: ~3,300 pure, ~5,300 compiled simulated requests per second); the router core
in an ingress replica runs the same compiled code.

    python -m deploy.native build   compile MODULES in place, if any is missing or stale
                                    (--strict: exit 1 if mypyc refuses the code), then fill
                                    numba's cache with the cache map's kernels
    python -m deploy.native check   exit 1 naming the compiled files that are stale
    python -m deploy.native clean   remove the extensions (back to pure Python)

``make`` builds them (the ``native`` target, before ``serve`` and every test target), and so
does a cluster node's set-up (``deploy/node-setup.sh``). The extensions sit next to their
sources, and Python imports an extension before a ``.py`` of the same name: an extension built
from other sources than those on disk would run old code. A compiled module bakes in its own
code, every other compiled module's (one build holds them all) and the types and constants of
what it imports, so what a build depends on is the import closure of MODULES: every module of
PACKAGES they import, transitively, as mypy reads them (``TYPE_CHECKING`` and function-level
imports count; see ``closure``). A build records a hash of each of those sources (with
pyproject's ``[tool.mypy]`` table and the build's recipe) in ``build/native/stamp.json``; the
compiled files are stale when the sources on disk hash otherwise. Editing a module outside the
closure (``deploy/cli.py``), or touching or checking out a file without changing its content,
costs no rebuild; editing one inside rebuilds the whole group (one runtime library holds every
compiled module's code). The test suite rebuilds stale modules before it starts
(``tests/conftest.py``), and ``kvroute`` warns.
Without a compiler (no mypy, no C compiler, no Python headers) ``build`` says so and leaves the
pure-Python modules to run: slower, the same results. mypyc type-checks the compiled modules
and every module they import, more strictly than ``make typecheck``: code it refuses fails
``make native`` (``--strict``), so a change cannot quietly lose the compiled build.

What a compiled module cannot be (so these are not in MODULES): one with numba kernels
(``cachemap.kernels``, ``cachemap.index``), one with msgspec ``Struct`` unions
(``cachemap.events``), or one whose classes are patched by interpreted code (``engines.bus.base``:
tests patch ``InProcessBus``). A class that interpreted code subclasses says so
(``@mypyc_attr(allow_interpreted_subclasses=True)``: ``router.placement.Scorer``, which the
baseline scorers extend), and an exception class stays a plain Python class
(``@mypyc_attr(native_class=False)``: mypyc cannot extend ``RuntimeError``); ``mypy_extensions``,
which gives that decorator, is a run-time dependency for it. A compiled frozen dataclass refuses
pickle's default restore (it assigns the fields), so the router's frozen records pickle through
their own ``__reduce__``. A compiled module's annotations are enforced at run time: a value of
the wrong type raises ``TypeError`` where pure Python would carry on, and a ``float``
annotation turns an int into a float.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.machinery
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

MODULES: tuple[str, ...] = (
    "cachemap.ingest",
    "engines.bus.liveness",
    "engines.sim.blocks",
    "engines.profile",
    "engines.sim.request",
    "engines.sim.scheduler",
    "engines.sim.virtual",
    "router.load",
    # the router's records, built per request and per instance, and its in-flight prompts
    "router.placement",
    "router.inflight",
    "router.core",
    "router.scorers.calibration",
    "router.scorers.kv_index",
    "router.scorers.kv_ttft",
    # the cluster simulator: its replay and wiring, what-if runs, and the settings and records
    # the loop reads (a compiled module reads a non-compiled class's attributes slowly)
    "simulation.cluster",
    "simulation.settings",
    "simulation.whatif",
    "simulation.wiring",
)

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so


def source(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def extension(module: str) -> Path:
    """Where the compiled ``module`` lives (whether or not it exists)."""
    src = source(module)
    return src.with_name(src.stem + SUFFIX)


# the project's packages: where compiled modules, and the modules they import, live
PACKAGES: tuple[str, ...] = (
    "cachemap",
    "deploy",
    "engines",
    "loadgen",
    "policies",
    "router",
    "simulation",
)


# NOTE: the group's runtime library (every compiled module's code; the extensions at the
# modules' paths are shims that import it) lives in a package, ``deploy.compiled__mypyc``: at
# the root, where mypyc puts it by default, it is importable only with the root on sys.path,
# which an installed ``kvroute`` command or a Ray worker does not have.
GROUP = "deploy.compiled"


def runtime_library() -> Path:
    return ROOT / (GROUP.replace(".", "/") + "__mypyc" + SUFFIX)


def work_dir() -> Path:
    """The build's C sources, objects and setup script, and its stamp (git-ignored)."""
    return ROOT / "build" / "native"


def stamp() -> Path:
    """What the compiled files in the tree were built from (``fingerprint``) and the compiled
    files themselves (size and mtime: any other file in their place is not this build's)."""
    return work_dir() / "stamp.json"


def _present() -> list[Path]:
    """Every compiled file in the tree: in PACKAGES (extensions, this build's runtime library),
    and a runtime library at the root (mypyc's default place: an earlier layout's)."""
    found = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob(f"*{SUFFIX}")]
    return sorted(found + list(ROOT.glob(f"*__mypyc{SUFFIX}")))


def _module_file(module: str) -> Path | None:
    """The source of a module of PACKAGES (None: not one, or no such module)."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(module: str, path: Path, text: bytes) -> set[str]:
    """Every module name ``text`` (``module``'s source) may import, anywhere in it: at the top,
    under ``if TYPE_CHECKING:``, in a function (mypy reads them all); for ``from x import y``,
    both ``x`` and ``x.y`` (``y`` may be a module). A source that does not parse imports
    nothing known (its hash has changed anyway)."""
    try:
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError):
        return set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], node.module or ""])
                base = base.strip(".")
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def closure(modules: tuple[str, ...] | None = None) -> dict[str, bytes]:
    """The sources a build of ``modules`` (MODULES) depends on, by path relative to ROOT: the
    modules themselves and every module of PACKAGES they import, transitively, with the
    packages (``__init__.py``) above each (Python runs them and mypy reads them)."""
    todo = list(MODULES if modules is None else modules)
    done: set[str] = set()
    found: dict[str, bytes] = {}
    while todo:
        module = todo.pop()
        if module in done:
            continue
        done.add(module)
        path = _module_file(module)
        if path is None:
            continue
        text = path.read_bytes()
        found[path.relative_to(ROOT).as_posix()] = text
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_imported(module, path, text) - done)
    return dict(sorted(found.items()))


def _recipe() -> str:
    """The setup script a build runs (what mypyc compiles, and how)."""
    paths = [str(source(m).relative_to(ROOT)) for m in MODULES]
    return (
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        f"setup(name='kvroute-native', ext_modules=mypycify({paths!r}, opt_level='3', "
        f"group_name={GROUP!r}, target_dir={str(work_dir().relative_to(ROOT))!r}))\n"
    )


def fingerprint() -> dict[str, Any]:
    """What the compiled code depends on: a hash of each source of MODULES' closure, mypy's
    configuration (pyproject's ``[tool.mypy]``: mypyc type-checks with it) and the recipe."""
    try:
        config = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {}).get("mypy")
    except (OSError, tomllib.TOMLDecodeError):
        config = None
    return {
        "recipe": _recipe(),
        "mypy": config,
        "sources": {p: hashlib.sha256(t).hexdigest() for p, t in closure().items()},
    }


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _record(built_from: dict[str, Any]) -> None:
    """Note in the stamp that the compiled files now present were built from ``built_from``."""
    built = {str(p.relative_to(ROOT)): _identity(p) for p in _present()}
    stamp().parent.mkdir(parents=True, exist_ok=True)
    stamp().write_text(json.dumps({"fingerprint": built_from, "built": built}, indent=1) + "\n")


def changes() -> list[str]:
    """Why the compiled files in the tree may run other code than the sources on disk: the
    sources of the closure added, removed or edited since the build (paths relative to ROOT),
    or a sentence (no record of the build, another configuration, a compiled file this build
    did not write). Empty: they were built from what is on disk."""
    try:
        record = json.loads(stamp().read_text())
        then, built = record["fingerprint"], record["built"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"no record of what they were built from ({stamp().relative_to(ROOT)})"]
    now = fingerprint()
    why = []
    if then.get("recipe") != now["recipe"]:
        why.append("the build's recipe changed (deploy/native.py)")
    if then.get("mypy") != now["mypy"]:
        why.append("pyproject.toml's [tool.mypy] changed")
    old, new = then.get("sources") or {}, now["sources"]
    why += [p for p in sorted(old.keys() | new.keys()) if old.get(p) != new.get(p)]
    for path in _present():
        rel = str(path.relative_to(ROOT))
        if rel in built and built[rel] != _identity(path):
            why.append(f"{rel} was replaced after the build")
    return why


def stale() -> list[str]:
    """Compiled files (relative paths) that may run other code than the sources on disk: all of
    them when the sources they were built from changed (``changes``), and any that is not this
    MODULES list's build (left by an earlier build)."""
    present = _present()
    if not present:
        return []
    wanted = {extension(m) for m in MODULES} | {runtime_library()}
    old = present if changes() else [p for p in present if p not in wanted]
    return [str(p.relative_to(ROOT)) for p in old]


def missing() -> list[str]:
    return [m for m in MODULES if not extension(m).exists()]


def clean() -> None:
    for path in _present():
        path.unlink(missing_ok=True)
    stamp().unlink(missing_ok=True)


def unavailable() -> str | None:
    """Why this machine cannot compile the modules (None: it can)."""
    import shutil
    import sysconfig

    try:
        import mypyc  # noqa: F401  (the compiler ships with mypy)
    except ImportError:
        return "mypy (mypyc) is not installed"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h)"
    return None


def build(force: bool = False, strict: bool = False) -> bool:
    """Compile MODULES in place unless all are built and fresh. False (and the pure-Python
    modules left to run) when this machine cannot compile, or when compiling fails; with
    ``strict``, a failure to compile (mypyc's type check refusing the code, a C error) raises
    ``RuntimeError`` instead."""
    if not force and not stale() and not missing():
        return True
    clean()
    why = unavailable()
    if why is not None:
        print(f"kvroute native: {why}; running pure Python", file=sys.stderr)
        return False
    import subprocess

    # NOTE: taken before compiling: a source edited while mypyc runs leaves the build stale
    built_from = fingerprint()
    # NOTE: what the ``mypyc`` command runs, with the group named; C sources, objects and
    # this script go under build/native (git-ignored). mypyc writes a C file only when its
    # text changes, and setuptools recompiles only an extension whose C changed: a build after
    # an edit that changes no compiled code costs mypy's type check alone.
    work = work_dir()
    work.mkdir(parents=True, exist_ok=True)
    script = work / "setup.py"
    script.write_text(_recipe())
    cmd = [sys.executable, str(script), "build_ext", "--inplace", "--build-temp", str(work)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or missing() or not runtime_library().exists():
        clean()
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        if strict:
            raise RuntimeError(f"compiling failed (exit {done.returncode}):\n{tail}")
        print(
            f"kvroute native: compiling failed (exit {done.returncode}); running pure Python\n"
            + tail,
            file=sys.stderr,
        )
        return False
    _record(built_from)
    return True


def describe(why: list[str]) -> str:
    """``changes``, shortened for one line."""
    more = f" and {len(why) - 3} more" if len(why) > 3 else ""
    return ", ".join(why[:3]) + more


def warn_if_stale() -> None:
    """For entry points: say so on stderr when compiled files may run old code."""
    old = stale()
    if old:
        why = changes() or [f"{p} is not this build's" for p in old]
        print(
            f"kvroute: {len(old)} compiled files may run old code ({describe(why)}): rebuild "
            "with `make native`, or remove them with `python -m deploy.native clean`",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.native", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("build", "check", "clean"))
    ap.add_argument("--force", action="store_true", help="build: rebuild even if fresh")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="build: exit 1 if compiling fails (pure Python only where no compiler is at hand)",
    )
    args = ap.parse_args(argv)
    if args.action == "clean":
        clean()
        return 0
    if args.action == "check":
        old = stale()
        for path in old:
            print(f"stale: {path}")
        if old and (why := changes()):
            print(f"kvroute native: changed since the build: {describe(why)}", file=sys.stderr)
        return 1 if old else 0
    try:
        ok = build(force=args.force, strict=args.strict)
    except RuntimeError as e:
        print(f"kvroute native: {e}", file=sys.stderr)
        return 1
    state = "compiled" if ok else "pure Python"
    print(f"kvroute native: {len(MODULES) - len(missing())}/{len(MODULES)} modules {state}")
    warm_kernels()
    return 0


def warm_kernels() -> None:
    """Fill numba's on-disk cache with the cache map's kernels (those of ``cachemap.kernels`` and
    ``cachemap.index``, through ``cachemap.map.warm_kernels``), so that no process compiles them
    at its first use."""
    import time

    from cachemap.map import warm_kernels

    t0 = time.perf_counter()
    names = warm_kernels()
    took = time.perf_counter() - t0
    print(f"kvroute native: {len(names)} cache map kernels compiled or loaded ({took:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
