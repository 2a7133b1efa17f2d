"""The engine's KV blocks: each running request's block table, what admission and growth cost in blocks, the prefix
cache's namespaces, and the step's block tables.

A request is admitted with the cached blocks of its context's longest cached prefix (held, not computed again: at
least its last token is always computed, for its logits) and grows a block at a time as its tokens are forwarded;
after every step its newly full blocks are named (:class:`BlockPool`). Requests asking for ``prompt_logprobs`` score
every prompt token, so they compute their whole prompt (their blocks are still named for others).

Namespaces: ``b"base"`` for the base model; ``adapter id | content digest | generation`` for an adapter, the
generation bumped by :meth:`KVSpace.drop` (the adapter was unregistered or refreshed to new content): its blocks are
unnamed and a request still running on the old content names nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..model.config import LlamaConfig
from .kv_blocks import BlockPool, block_names
from .request import Request

BASE_NAMESPACE = b"base"


def block_bytes(config: LlamaConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one KV block: ``block_size`` positions of every layer's K and V."""
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize
    return block_size * per_token


@dataclass
class PrefixStats:
    """Prefix-cache counters since the engine started (vLLM's ``prefix_cache_queries`` / ``_hits``)."""

    queried_tokens: int = 0  # context tokens of admitted requests that could have been cached
    hit_tokens: int = 0  # of them, found cached (not computed)
    queried_requests: int = 0
    hit_requests: int = 0  # admitted with at least one cached block
    preemptions: int = 0  # running requests preempted for blocks (recomputed later)
    dropped_blocks: int = 0  # cached blocks unnamed because their adapter was unregistered or refreshed


class KVSpace:
    """The KV blocks as the engine hands them out. Not thread-safe: called under the engine's lock."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_sequences: int,
        digest_of: Callable[[str], str],
        reserve: int | None = None,
    ) -> None:
        """``digest_of(adapter_id)``: the adapter's content digest now; ``reserve``: free blocks admission leaves for
        running sequences to grow into (None: 1 % of the pool, as vLLM's watermark, at least 1)."""
        self.pool = pool
        self.block_size = block_size
        self.max_sequences = max_sequences
        self._digest_of = digest_of
        self._reserve = max(1, pool.num_blocks // 100) if reserve is None else reserve
        self._generation: dict[str, int] = {}
        self._live: dict[str, set[bytes]] = {}  # adapter id -> its namespaces in use
        self.running = 0  # sequences holding blocks
        self.stats = PrefixStats()

    @property
    def free(self) -> int:
        return self.pool.free

    @property
    def reserve(self) -> int:
        return self._reserve

    @property
    def seats(self) -> int:
        return self.max_sequences - self.running

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def growth(self, request: Request, count: int) -> int:
        return max(0, self.blocks_for(request.position + count) - len(request.blocks))

    def freed_by(self, request: Request) -> int:
        return sum(1 for block in request.blocks if self.pool.holders(block) == 1)

    def admission(self, request: Request, budget: int) -> tuple[int, int]:
        names = self._names(request, self._namespace(request.adapter_id))
        cached, revived = self.pool.cached_prefix(names)
        tokens = cached * self.block_size
        count = min(len(request.context) - tokens, budget)
        return tokens, self.blocks_for(tokens + count) - cached + revived

    def admit(self, request: Request) -> int:
        """Start a request: hold its cached prefix; returns the prompt tokens it holds (its ``prefilled``)."""
        namespace = self._namespace(request.adapter_id)
        if request.adapter_id is not None:
            self._live.setdefault(request.adapter_id, set()).add(namespace)
        names = self._names(request, namespace)
        blocks = self.pool.match(names)
        request.namespace, request.blocks, request.named = namespace, blocks, len(blocks)
        request.last_name = names[len(blocks) - 1] if blocks else b""
        request.prefilled = request.cached_tokens = len(blocks) * self.block_size
        self.running += 1
        if not request.resumed:
            self.stats.queried_requests += 1
            self.stats.queried_tokens += len(request.context) - 1
            self.stats.hit_tokens += request.cached_tokens
            self.stats.hit_requests += bool(blocks)
        return request.prefilled

    def grow(self, request: Request, count: int) -> bool:
        """Blocks for the request's next ``count`` tokens; False (nothing taken) when the pool is short."""
        more = self.growth(request, count)
        if more == 0:
            return True
        blocks = self.pool.allocate(more)
        if blocks is None:
            return False
        request.blocks.extend(blocks)
        return True

    def commit(self, request: Request) -> None:
        """Name the request's blocks its forwarded tokens filled since the last call (unless its namespace was
        dropped meanwhile)."""
        full = min(request.position // self.block_size, len(request.blocks))
        if full <= request.named or not self._is_live(request):
            return
        tokens = request.tokens[request.named * self.block_size : full * self.block_size]
        names = block_names(request.namespace, tokens, self.block_size, request.last_name)
        for block, name in zip(request.blocks[request.named : full], names, strict=True):
            self.pool.name(block, name, request.namespace)
        request.named, request.last_name = full, names[-1]

    def release(self, request: Request) -> None:
        """The request stops holding its blocks (finished, failed, cancelled or preempted)."""
        if request.namespace:
            self.pool.release(request.blocks)
            self.running -= 1
        request.blocks, request.named, request.namespace, request.last_name = [], 0, b"", b""

    def reset(self, request: Request) -> None:
        """Back to waiting (preempted, or requeued in its first step): its blocks released, its prompt and the output
        it has (``resumed``) to compute again; prompt logprobs, scored once, are kept once a token was drawn."""
        self.release(request)
        request.prefilled = 0
        if request.output:
            request.resumed = tuple(request.output)
        else:
            request.prompt_logprobs.clear()

    def drop(self, adapter_id: str) -> int:
        """Forget an adapter's cached blocks (unregistered, or refreshed to new content); returns how many."""
        self._generation[adapter_id] = self._generation.get(adapter_id, 0) + 1
        dropped = sum(self.pool.drop(namespace) for namespace in self._live.pop(adapter_id, set()))
        self.stats.dropped_blocks += dropped
        return dropped

    def tables(self, requests: Sequence[Request], rows: int | None = None, width: int | None = None) -> torch.Tensor:
        """The step's block tables, row i the blocks of ``requests[i]``, padded with the spare block (the pool's
        ``num_blocks``) to ``width`` (None: the longest) and ``rows`` rows (None: one per request). Shape: [rows,
        width] int64 on the host."""
        width = width or max(1, max(len(r.blocks) for r in requests))
        table = torch.full((rows or len(requests), width), self.pool.num_blocks, dtype=torch.long)
        for i, request in enumerate(requests):
            table[i, : len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.long)
        return table

    def _namespace(self, adapter_id: str | None) -> bytes:
        if adapter_id is None:
            return BASE_NAMESPACE
        generation = self._generation.get(adapter_id, 0)
        return f"{adapter_id}|{self._digest_of(adapter_id)}|{generation}".encode()

    def _is_live(self, request: Request) -> bool:
        return request.adapter_id is None or request.namespace in self._live.get(request.adapter_id, ())

    def _names(self, request: Request, namespace: bytes) -> list[bytes]:
        """Names of the request's context blocks it may take from the cache: every full block short of its last
        token; none with prompt_logprobs (it scores every prompt token) or without caching."""
        if request.params.prompt_logprobs is not None or not self.pool.caching:
            return []
        usable = (len(request.context) - 1) // self.block_size
        known_namespace, names = request.context_names
        if known_namespace != namespace or len(names) != usable:  # asked every step it waits: hashed once
            names = tuple(block_names(namespace, request.context[: usable * self.block_size], self.block_size))
            request.context_names = (namespace, names)
        return list(names)
