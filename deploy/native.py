"""The hot pure-Python modules, compiled to C extensions with mypyc (mypy's compiler).

The cluster simulator spends its time in the sim engines' scheduler and block manager, the
router core's load tracking and scorer, and KV-event translation: typed Python that mypyc
compiles as it stands, with the same results (every figure of ``kvroute simulate --json``
identical). The simulator runs ~1.4x faster compiled (``benchmarks/sim_bench.py``); the router
core in an ingress replica runs the same compiled code.

    python -m deploy.native build   compile MODULES in place, if any is missing or stale
                                    (--strict: exit 1 if mypyc refuses the code)
    python -m deploy.native check   exit 1 naming the compiled files that are stale
    python -m deploy.native clean   remove the extensions (back to pure Python)

``make`` builds them (the ``native`` target, before ``serve`` and every test target), and so
does a cluster node's set-up (``deploy/node-setup.sh``). The extensions sit next to their
sources, and Python imports an extension before a ``.py`` of the same name: an extension older
than its source would run old code. So every module is rebuilt whenever a source of the project
changed (a compiled module also bakes in the types and constants it imports), the test suite
rebuilds before it starts (``tests/conftest.py``), and ``kvroute`` warns.
Without a compiler (no mypy, no C compiler, no Python headers) ``build`` says so and leaves the
pure-Python modules to run: slower, the same results. mypyc type-checks the compiled modules
and every module they import, more strictly than ``make typecheck``: code it refuses fails
``make native`` (``--strict``), so a change cannot quietly lose the compiled build.

What a compiled module cannot be (so these are not in MODULES): one with numba kernels
(``cachemap.map``, ``cachemap.index``), one with msgspec ``Struct`` unions (``cachemap.events``),
one whose classes are subclassed or patched by interpreted code (``cachemap.bus``: tests
subclass and patch ``InProcessBus``), or one defining a ``RuntimeError`` subclass
(``router.placement``). A compiled module's annotations are enforced at run time: a value of
the wrong type raises ``TypeError`` where pure Python would carry on, and a ``float``
annotation turns an int into a float.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODULES: tuple[str, ...] = (
    "cachemap.ingest",
    "engines.liveness",
    "engines.sim.blocks",
    "engines.sim.profile",
    "engines.sim.request",
    "engines.sim.scheduler",
    "engines.sim.virtual",
    "loadgen.simulator",
    "router.load",
    "router.state",
    "router.scorers.kv_ttft",
)

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so


def source(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def extension(module: str) -> Path:
    """Where the compiled ``module`` lives (whether or not it exists)."""
    src = source(module)
    return src.with_name(src.stem + SUFFIX)


# where compiled modules and what they import live: any source here may be baked into them
PACKAGES: tuple[str, ...] = ("cachemap", "deploy", "engines", "loadgen", "policies", "router")


# NOTE: the group's runtime library (every compiled module's code; the extensions at the
# modules' paths are shims that import it) lives in a package, ``deploy.compiled__mypyc``: at
# the root, where mypyc puts it by default, it is importable only with the root on sys.path,
# which an installed ``kvroute`` command or a Ray worker does not have.
GROUP = "deploy.compiled"


def runtime_library() -> Path:
    return ROOT / (GROUP.replace(".", "/") + "__mypyc" + SUFFIX)


def _present() -> list[Path]:
    """Every compiled file in the tree: in PACKAGES (extensions, this build's runtime library),
    and a runtime library at the root (mypyc's default place: an earlier layout's)."""
    found = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob(f"*{SUFFIX}")]
    return sorted(found + list(ROOT.glob(f"*__mypyc{SUFFIX}")))


def stale() -> list[str]:
    """Compiled files (relative paths) that may run other code than the sources on disk: older
    than the newest source in PACKAGES (a compiled module bakes in what it was compiled
    against: its own code, every other compiled module's, and the types and constants it
    imported), or not this MODULES list's build (left by an earlier build)."""
    present = _present()
    if not present:
        return []
    newest = max(p.stat().st_mtime for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    wanted = {extension(m) for m in MODULES} | {runtime_library()}
    old = [p for p in present if p.stat().st_mtime < newest or p not in wanted]
    return [str(p.relative_to(ROOT)) for p in old]


def missing() -> list[str]:
    return [m for m in MODULES if not extension(m).exists()]


def clean() -> None:
    for path in _present():
        path.unlink(missing_ok=True)


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

    paths = [str(source(m).relative_to(ROOT)) for m in MODULES]
    # NOTE: what the ``mypyc`` command runs, with the group named; C sources, objects and
    # this script go under build/native (git-ignored)
    work = ROOT / "build" / "native"
    work.mkdir(parents=True, exist_ok=True)
    script = work / "setup.py"
    script.write_text(
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        f"setup(name='kvroute-native', ext_modules=mypycify({paths!r}, opt_level='3', "
        f"group_name={GROUP!r}, target_dir={str(work.relative_to(ROOT))!r}))\n"
    )
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
    # NOTE: setuptools copies an extension it did not need to relink (its C is unchanged)
    # with the old file's time, which would leave it "older than the sources" for good
    for path in _present():
        os.utime(path)
    return True


def warn_if_stale() -> None:
    """For entry points: say so on stderr when compiled files may run old code."""
    old = stale()
    if old:
        print(
            f"kvroute: {len(old)} compiled files are older than the sources (e.g. {old[0]}) "
            "and may run old code: rebuild with `make native`, or remove them with "
            "`python -m deploy.native clean`",
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
        return 1 if old else 0
    try:
        ok = build(force=args.force, strict=args.strict)
    except RuntimeError as e:
        print(f"kvroute native: {e}", file=sys.stderr)
        return 1
    state = "compiled" if ok else "pure Python"
    print(f"kvroute native: {len(MODULES) - len(missing())}/{len(MODULES)} modules {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
