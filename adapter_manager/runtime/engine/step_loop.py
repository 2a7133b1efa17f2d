"""The engine's background thread: steps whenever there is work, until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class StepLoop:
    """Calls ``step`` in a daemon thread while ``has_work()``; sleeps on ``work`` (notified by submit) otherwise. A
    step that raises is logged and the loop goes on (the step already failed its requests)."""

    def __init__(self, step: Callable[[], object], work: threading.Condition, has_work: Callable[[], bool]) -> None:
        self._step, self._work, self._has_work = step, work, has_work
        self._thread: threading.Thread | None = None
        self.stopping = False  # read by a step that waits for adapters: it returns early once set

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        with self._work:
            self.stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._work:
            self.stopping = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._work:
                while not self.stopping and not self._has_work():
                    self._work.wait()
                if self.stopping:
                    return
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the loop must survive; the step already failed its requests
                log.exception("engine step failed")
