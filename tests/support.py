"""Helpers shared by test modules of several tiers (not fixtures, not tests)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from deploy.local import LocalStack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, stack: LocalStack, port: int) -> None:
        self.stack, self.port = stack, port
        self.server = uvicorn.Server(
            uvicorn.Config(stack.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = loop = asyncio.new_event_loop()
        loop.run_until_complete(self.stack.start())
        try:
            loop.run_until_complete(self.server.serve())
        finally:
            loop.run_until_complete(self.stack.stop())
            loop.close()

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
