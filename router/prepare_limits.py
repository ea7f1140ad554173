"""What preparing a request may cost the ingress's event loop: cheap bounds that refuse a prompt
which cannot fit the context before it is validated or tokenized, and lanes that run the
tokenizer and chat template off the loop with bounded concurrency.

One router replica serves every client from one event loop. Tokenizing a prompt near the body
limit takes seconds (3.9 MB of words: 2.9 s with the tiny model's tokenizer here), and
validating or templating a chat of 100k messages most of a second; on the loop, every other
client waits that long. So:

- ``PromptBounds`` refuses, from the raw body, a prompt whose size alone proves it longer than
  the context: characters over the longest token of a byte-level tokenizer, token ids, or chat
  messages times the fewest tokens the template adds per message. A body that asks to be
  truncated (``truncate_prompt_tokens``) is exempt: it may be long.
- ``PrepareLanes`` runs a prompt's tokenization inline when it is small (a few ms at most), in a
  ``medium`` lane of its own otherwise, and in a ``large`` lane of one worker when it is near
  the body limit, so a flood of huge prompts queues behind itself, not behind normal traffic;
  past a lane's waiting bound the request is refused (429), not queued without end. The Rust
  tokenizer releases the GIL while it encodes, so the loop goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from router.admission import Rejected
from router.api_errors import APIError

T = TypeVar("T")

# characters of prompt text tokenized inline on the loop (~0.75 us each here: <= ~6 ms)
INLINE_CHARS = 8 << 10
# above this, the ``large`` lane (one worker): near the body limit, a hostile size
LARGE_CHARS = 256 << 10
# the roles whose per-message template cost ``PromptBounds`` measures and counts
COUNTED_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptBounds:
    """Lower bounds on a prompt's tokens that need no tokenizer run: ``chars_per_token``, the
    most characters one token can cover (None: the tokenizer may drop characters, no bound),
    and ``tokens_per_message``, the fewest tokens the chat template adds for one message of a
    ``COUNTED_ROLES`` role (0: unknown, no bound)."""

    max_model_len: int
    chars_per_token: int | None
    tokens_per_message: int

    def check(self, body: Mapping[str, Any], chat: bool) -> None:
        """A 400 (``context_length_exceeded``) when ``body``'s prompt is longer than the context
        by its size alone; nothing for a body that asks for truncation or is malformed (the
        validation that follows names what is wrong)."""
        if body.get("truncate_prompt_tokens") is not None:
            return
        if chat:
            messages = body.get("messages")
            if isinstance(messages, list) and self.tokens_per_message > 0:
                counted = sum(
                    1 for m in messages if isinstance(m, dict) and m.get("role") in COUNTED_ROLES
                )
                self._refuse(counted * self.tokens_per_message, "messages", f"{counted} messages")
            return
        prompt = body.get("prompt")
        prompts = [prompt]
        if isinstance(prompt, list) and prompt and not _is_ids(prompt):
            prompts = prompt  # several prompts
        for p in prompts:
            if isinstance(p, str) and self.chars_per_token:
                self._refuse(-(-len(p) // self.chars_per_token), "prompt", f"{len(p)} characters")
            elif isinstance(p, list):
                self._refuse(len(p), "prompt", f"{len(p)} token ids")

    def _refuse(self, at_least: int, param: str, what: str) -> None:
        if at_least >= self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has at least {at_least} ({what})",
                param=param,
                code="context_length_exceeded",
            )


def _is_ids(prompt: list[Any]) -> bool:
    return isinstance(prompt[0], int)


class Lane:
    """A thread pool of ``workers`` for preparation jobs, and at most ``max_waiting`` jobs
    waiting for one of them; past that, ``Rejected`` (429)."""

    def __init__(self, name: str, workers: int, max_waiting: int) -> None:
        self.name, self.workers, self.max_waiting = name, workers, max_waiting
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvroute-prepare-{name}")
        self.jobs = 0  # running and waiting
        self.refused = 0

    def check_room(self) -> None:
        """``Rejected`` (429) when every worker is busy and ``max_waiting`` jobs wait."""
        if self.jobs >= self.workers + self.max_waiting:
            self.refused += 1
            raise Rejected(
                f"the ingress is preparing {self.jobs} {self.name} requests; retry shortly",
                1.0,
                code="overloaded",
            )

    async def run(self, job: Callable[[], T]) -> T:
        self.check_room()
        self.jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)
        finally:
            self.jobs -= 1


class PrepareLanes:
    """Where a job of ``size`` (a prompt's characters, a body's bytes) runs: inline, the
    ``medium`` lane or the ``large`` one (the module docstring)."""

    def __init__(self, medium_workers: int = 2, large_waiting: int = 4) -> None:
        self.medium = Lane("medium", medium_workers, 64)
        self.large = Lane("large", 1, large_waiting)

    def lane(self, size: int) -> Lane | None:
        if size <= INLINE_CHARS:
            return None
        return self.medium if size <= LARGE_CHARS else self.large

    def check_room(self, size: int) -> None:
        """``Rejected`` when a job of ``size`` would find its lane full: for a body, from its
        Content-Length, before it is read (a flood of huge bodies costs the loop nothing)."""
        lane = self.lane(size)
        if lane is not None:
            lane.check_room()

    async def run(self, size: int, job: Callable[[], T]) -> T:
        lane = self.lane(size)
        if lane is None:
            return job()
        return await lane.run(job if lane is self.medium else lambda: _trimmed(job))


def _trimmed(job: Callable[[], T]) -> T:
    """``job()``, then the C heap's free memory given back to the system: the tokenizer's
    buffers for a prompt of megabytes would otherwise stay in the worker's malloc arena."""
    try:
        return job()
    finally:
        if _malloc_trim is not None:
            _malloc_trim(0)


def _libc_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[assignment]
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


_malloc_trim = _libc_malloc_trim()
