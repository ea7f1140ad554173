"""The pool's master: a ``mooncake_master`` process and the HTTP metadata server its clients
find each other's segments through, started and stopped as one.

Both bind ``host`` only (127.0.0.1 by default; a cluster passes its private address). The
metadata server is the wheel's own (``python -m mooncake.http_metadata_server``), run beside
the master rather than the master's embedded one: in ``mooncake-transfer-engine-non-cuda``
0.3.13.post1 the embedded server listens on 0.0.0.0 whatever ``--http_metadata_server_host``
says (measured: ``ss -ltn``), and nothing of the pool may listen beyond ``host``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from engines.ports import free_port

__all__ = ["MasterConfig", "PoolMaster", "PoolUnavailable", "find_master_binary", "main"]

log = logging.getLogger(__name__)

_BINARY = "mooncake_master"


class PoolUnavailable(RuntimeError):
    """The pool cannot run here: what is missing and how to install it."""


def _check_libibverbs() -> None:
    """The Mooncake binaries link ``libibverbs.so.1`` even over TCP (Debian's ``libibverbs1``)."""
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as e:
        raise PoolUnavailable(
            "the Mooncake pool needs libibverbs.so.1 (Debian package libibverbs1): "
            f"`make mooncake` or `apt-get install libibverbs1` ({e})"
        ) from None


def find_master_binary() -> Path:
    """The ``mooncake_master`` executable the Mooncake wheel ships (inside its package folder;
    the one on PATH is a Python shim that execs it), after checking libibverbs is present.

    Raises ``PoolUnavailable`` naming what to install."""
    spec = importlib.util.find_spec("mooncake")
    candidates: list[Path] = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / _BINARY for p in spec.submodule_search_locations]
    on_path = shutil.which(_BINARY)
    if on_path is not None:
        candidates.append(Path(on_path))
    exe = next((c for c in candidates if c.is_file()), None)
    if exe is None:
        raise PoolUnavailable(
            "mooncake_master not found: install the Mooncake wheel "
            "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1; `make` does)"
        )
    _check_libibverbs()
    return exe


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Where and how the master listens. A port of 0 takes a free one (``engines.ports``)."""

    host: str = "127.0.0.1"
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    # Seconds a client stays alive at the master without a heartbeat (Mooncake's default 10).
    client_ttl_s: int = 10
    # Milliseconds a read lease holds an object against eviction and removal (default 10 s).
    kv_lease_ttl_ms: int = 10_000
    # Fraction of the pool in use at which the master evicts, and the share it evicts.
    eviction_high_watermark: float = 0.9
    eviction_ratio: float = 0.05
    start_timeout_s: float = 20.0
    stop_timeout_s: float = 5.0


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _stop(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Terminate, then kill what is still running after ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pool: pid %d ignored SIGTERM for %.0f s, killing it", p.pid, timeout_s)
            p.kill()
            p.wait()


class PoolMaster:
    """A running pool master. ``start()`` returns once both servers accept connections;
    ``stop()`` (or leaving the ``with`` block, or the object being collected) ends them."""

    def __init__(self, config: MasterConfig | None = None, log_dir: Path | None = None) -> None:
        self.config = config or MasterConfig()
        self._own_dir = log_dir is None
        self.log_dir = (
            Path(tempfile.mkdtemp(prefix="kvroute-pool-")) if log_dir is None else log_dir
        )
        self.rpc_port = self.config.rpc_port
        self.metadata_port = self.config.metadata_port
        self.metrics_port = self.config.metrics_port
        self._procs: list[subprocess.Popen[bytes]] = []
        self._finalizer: weakref.finalize[..., PoolMaster] | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service (a store client's ``master_server_addr``)."""
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The metadata server's URL (a store client's ``metadata_server``)."""
        return f"http://{self.config.host}:{self.metadata_port}/metadata"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.poll() is None]

    @property
    def log_path(self) -> Path:
        return self.log_dir / "mooncake_master.log"

    def running(self) -> bool:
        return len(self._procs) == 2 and all(p.poll() is None for p in self._procs)

    def _master_args(self, exe: Path) -> list[str]:
        c = self.config
        return [
            str(exe),
            f"--rpc_address={c.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={c.host}",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={c.client_ttl_s}",
            f"--default_kv_lease_ttl={c.kv_lease_ttl_ms}",
            f"--eviction_high_watermark_ratio={c.eviction_high_watermark}",
            f"--eviction_ratio={c.eviction_ratio}",
            "--enable_http_metadata_server=false",
            "--rpc_thread_num=2",
        ]

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / log_name, "ab") as out:
            return subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def start(self) -> PoolMaster:
        """Start both servers (on free ports where the config says 0, drawing again if a port
        was taken meanwhile). Raises ``PoolUnavailable`` when the binary or libibverbs is
        missing, ``RuntimeError`` with the log's tail when the master does not come up."""
        if self._procs:
            raise RuntimeError("the pool master is already started")
        exe = find_master_binary()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        auto = self.config.rpc_port == 0 or self.config.metadata_port == 0
        attempts = 3 if auto else 1
        for attempt in range(attempts):
            self.rpc_port = self.config.rpc_port or free_port()
            self.metadata_port = self.config.metadata_port or free_port()
            self.metrics_port = self.config.metrics_port or free_port()
            meta_args = [sys.executable, "-m", "mooncake.http_metadata_server"]
            meta_args += ["--host", self.config.host, "--port", str(self.metadata_port)]
            meta_args += ["--log-level", "WARNING"]
            self._procs = [
                self._spawn(self._master_args(exe), "mooncake_master.log"),
                self._spawn(meta_args, "metadata_server.log"),
            ]
            self._finalizer = weakref.finalize(self, _stop, list(self._procs), 2.0)
            try:
                self._wait_ready()
            except RuntimeError:
                self.stop()
                if attempt + 1 == attempts:
                    raise
                continue
            log.info(
                "pool: master %s (pid %d), metadata %s (pid %d), logs in %s",
                self.master_address,
                self._procs[0].pid,
                self.metadata_url,
                self._procs[1].pid,
                self.log_dir,
            )
            return self
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        host = self.config.host
        deadline = time.monotonic() + self.config.start_timeout_s
        pending = {"master": self.rpc_port, "metadata server": self.metadata_port}
        while pending:
            for name, proc in zip(("master", "metadata server"), self._procs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"pool: the {name} exited with code {proc.returncode} at start; "
                        f"log tail:\n{self._log_tail()}"
                    )
            for name, port in list(pending.items()):
                if _port_open(host, port):
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"pool: {', '.join(pending)} not accepting connections on {host} after "
                    f"{self.config.start_timeout_s:.0f} s; log tail:\n{self._log_tail()}"
                )
            if pending:
                time.sleep(0.02)

    def _log_tail(self, lines: int = 15) -> str:
        chunks: list[str] = []
        for name in ("mooncake_master.log", "metadata_server.log"):
            with contextlib.suppress(OSError):
                text = (self.log_dir / name).read_text(errors="replace").splitlines()
                chunks += [f"[{name}] {line[:300]}" for line in text[-lines:]]
        return "\n".join(chunks)

    def kill_master(self) -> None:
        """SIGKILL the master alone (fault injection: the metadata server stays up)."""
        if self._procs and self._procs[0].poll() is None:
            self._procs[0].kill()
            self._procs[0].wait()

    def restart_master(self) -> None:
        """Start the master again on the same ports, after ``kill_master`` or a crash (its
        contents are gone; clients remount their segments within a heartbeat or two)."""
        if not self._procs:
            raise RuntimeError("the pool master was never started")
        if self._procs[0].poll() is None:
            raise RuntimeError("the master is still running")
        self._procs[0] = self._spawn(self._master_args(find_master_binary()), "mooncake_master.log")
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, list(self._procs), 2.0)
        try:
            self._wait_ready()
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate both servers (kill after ``stop_timeout_s``); idempotent."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        _stop(self._procs, self.config.stop_timeout_s)
        self._procs = []
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> PoolMaster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m engines.pool --host IP ...``: run a master in the foreground until
    SIGTERM or SIGINT (a cluster's head: ``deploy/node-setup.sh pool``)."""
    import argparse
    import signal
    import threading

    p = argparse.ArgumentParser(prog="python -m engines.pool", description=main.__doc__)
    p.add_argument("--host", default="127.0.0.1", help="the address both servers bind")
    p.add_argument("--rpc-port", type=int, default=0)
    p.add_argument("--metadata-port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--client-ttl-s", type=int, default=10, help="seconds (Mooncake's default)")
    p.add_argument("--log-dir", type=Path, help="the servers' logs (default: a temporary dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    config = MasterConfig(
        host=args.host,
        rpc_port=args.rpc_port,
        metadata_port=args.metadata_port,
        metrics_port=args.metrics_port,
        client_ttl_s=args.client_ttl_s,
    )
    with PoolMaster(config, log_dir=args.log_dir) as master:
        print(f"pool master {master.master_address} metadata {master.metadata_url}", flush=True)
        while not stop.wait(1.0):
            if not master.running():
                log.error("pool: a server exited; log tail:\n%s", master._log_tail())
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
