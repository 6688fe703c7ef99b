"""The runtime's thread: it runs callers' commands (submit, abort, stats), moves messages between
the conductor and the workers and runs inline work (the driver's ``pump``), and watches the
workers, until stopped; then whatever is still in flight ends as aborted. The ``Runtime`` owns one."""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from mstar.runtime.failures import FailureKind
from mstar.runtime.openmp import release_thread_pool

__all__ = ["RuntimeLoop"]


class RuntimeLoop:
    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self._conductor: Any = None
        self._commands: queue.Queue = queue.Queue()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # set when the runtime's thread failed

    def start(self, conductor: Any) -> threading.Thread:
        self._conductor, self._stop = conductor, False
        self._thread = threading.Thread(target=self._drive, name="mstar-runtime", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop the thread (in-flight requests end as aborted) and wait for it."""
        self._stop = True
        self._driver.wake()
        self._thread.join()
        self._thread = None

    def command(self, fn) -> None:
        """Run ``fn`` on the runtime's thread."""
        self._commands.put(fn)
        self._driver.wake()

    def _drive(self) -> None:
        """Run commands from callers -> move messages and run work -> watch the workers; repeat.
        The loop runs in inference mode, entered once: entering it around every forward is a fixed
        cost paid on every step."""
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        conductor, driver = self._conductor, self._driver
        busy = False
        try:
            while not self._stop:
                # the queue's deque read without its lock (an item put meanwhile is seen next time
                # round: putting it also wakes the loop)
                did = bool(self._commands.queue) and self._run_commands()
                did = driver.pump(conductor, did) or did
                if driver.lost is not None:  # a rank is down: other ranks may hold state of any request
                    self._fail_all(FailureKind.WORKER_LOST, driver.lost)
                if busy and not did:  # going idle: other threads' torch work must not wake ours (openmp.py)
                    release_thread_pool()
                busy = did
                if not did:
                    driver.idle()
            # shutting down: whatever is still in flight ends as aborted, so no caller waits forever
            self._run_commands()
            for rid in list(conductor.requests):
                conductor.abort(rid)
        except BaseException as e:  # noqa: BLE001 - surface runtime bugs to every waiting request
            self.lost = f"runtime error: {type(e).__name__}: {e}"
            self._fail_all(FailureKind.INTERNAL, self.lost)
            raise

    def _run_commands(self) -> bool:
        did = False
        while not self._commands.empty():
            self._commands.get()()
            did = True
        return did

    def _fail_all(self, kind: FailureKind, error: str) -> None:
        for rid in list(self._conductor.requests):
            self._conductor.fail(rid, error, kind)
        self._conductor.stats.fail(error)
        self._conductor.trace_calls.fail(error)
