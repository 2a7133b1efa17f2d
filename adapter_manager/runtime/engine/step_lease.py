"""Pinning a step's adapters: one ``manager.acquire`` for the step, where a request whose adapter cannot be pinned
now goes back to waiting or fails alone, and the rest of the step runs."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from adapter_manager import (
    AdapterConflictError,
    AdapterError,
    AdapterManager,
    AdapterNotReadyError,
    SlotLease,
    SlotsExhaustedError,
)

from .request import Request
from .scheduler import ScheduledChunk

SLOT_WAIT_S = 10.0
"""Longest a step of running requests only waits for slot room (a prefetch copy finishing)."""


def acquire_step(
    manager: AdapterManager,
    chunks: list[ScheduledChunk],
    admitted: Sequence[Request],
    running: Collection[str | None],
    requeue: Callable[[Request], None],
    fail: Callable[[Request, AdapterError], None],
) -> SlotLease:
    """Pin the adapters of ``chunks`` (edited in place: a request dropped from the step loses its chunk).

    ``admitted``: the step's newly admitted requests; ``running``: the adapters of the requests already running. A
    request whose adapter fails is failed alone (``fail``); when slots run out (an operator pinned one meanwhile)
    the newest admitted requests go back to waiting (``requeue``), and so do the admitted requests of an adapter the
    host tier evicted since it was found ready (placing it now would mean preparing it inside the step). With
    prefetching on, only the newcomers' adapters are limited to a copy from the host (``prepared_only``).
    """
    requeueable = [r for r in admitted if r.adapter_id is not None]
    gated = manager.prefetching
    while True:
        newcomers = {r.adapter_id for r in requeueable} - set(running) if gated else ()
        try:
            return manager.acquire((c.request.adapter_id for c in chunks), prepared_only=newcomers)
        except AdapterNotReadyError as err:
            back = [r for r in requeueable if r.adapter_id == err.adapter]
            if not back:
                raise
            for request in reversed(back):
                requeueable.remove(request)
                chunks[:] = [c for c in chunks if c.request is not request]
                requeue(request)
        except SlotsExhaustedError:
            if not requeueable:  # only running requests left: wait for a load or an unpin to make room
                return manager.acquire((c.request.adapter_id for c in chunks), wait_s=SLOT_WAIT_S)
            request = requeueable.pop()
            chunks[:] = [c for c in chunks if c.request is not request]
            requeue(request)
        except AdapterError as err:
            failed = [c.request for c in chunks if c.request.adapter_id == err.adapter]
            if not failed:
                raise
            chunks[:] = [c for c in chunks if c.request.adapter_id != err.adapter]
            for request in failed:
                if request in requeueable:
                    requeueable.remove(request)
                fail(request, err)


def hold_contents(
    chunks: list[ScheduledChunk],
    lease: SlotLease,
    restart: Callable[[Request], None],
    fail: Callable[[Request, AdapterError], None],
) -> None:
    """Keep in the step only the requests whose pinned slot holds the content their tokens so far came from (edited
    in place). A request's content is the one its first step's slot held (not the registry's, which a refresh
    changes before the slot does). Where a refresh or an unregistration has changed it since, a request with no
    token yet starts again on the new content (``restart``) and one with tokens fails (``fail``, typed): the rest
    of its answer would come from other weights than its first tokens, matching neither version."""
    contents = lease.contents
    for chunk in list(chunks):
        request = chunk.request
        if request.adapter_id is None:
            continue
        content = contents[request.adapter_id]
        if request.content is None:
            request.content = content
        elif request.content != content:
            chunks.remove(chunk)
            if request.output:
                message = "was updated to new content while this request was generating; send it again"
                fail(request, AdapterConflictError(request.adapter_id, message))
            else:
                restart(request)
