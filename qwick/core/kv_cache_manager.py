"""Paged KV cache bookkeeping: block pool, per-request block tables, prefix caching. Torch-free.

The GPU holds `num_blocks` KV blocks of `block_size` token slots each, allocated once by the runner. This
module only decides which block ids each request uses; the runner turns the tables into tensors.

Block 0 is the null block: never handed out, so the runner can point padding slots at it.

Prefix caching. Every full block of a request is described by a `_CacheEntry`: its tokens, the cache salt
and its parent entry (the block before it). The cache maps a chained hash value to an entry; a lookup walks a
request's full blocks in order and accepts an entry only if its tokens, salt and parent *entry object* match,
so a hash collision can never produce a false hit, even transitively. Several physical blocks may hold the
same content (an entry keeps all of them), which happens when a hit is capped and the last block is
recomputed. Freed blocks keep their entry and wait in an LRU free queue; they are evicted (entry dropped)
only when a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from qwick.core.request import Request

NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    """Chained hash of one full block. Collisions are tolerated (entries are verified), so the fast
    builtin hash is enough; the cache lives in one process, so per-process str hash seeds are fine."""
    return hash((parent_hash, token_ids, salt))


class _CacheEntry:
    """The content of one full block, in the context of everything before it."""

    __slots__ = ("hash_value", "token_ids", "salt", "parent", "block_ids")

    def __init__(
        self, hash_value: int, token_ids: tuple[int, ...], salt: str | None, parent: _CacheEntry | None
    ) -> None:
        self.hash_value = hash_value
        self.token_ids = token_ids
        self.salt = salt
        self.parent = parent
        self.block_ids: list[int] = []  # physical blocks holding this content (usually one)

    def matches(self, token_ids: tuple[int, ...], salt: str | None, parent: _CacheEntry | None) -> bool:
        return self.parent is parent and self.token_ids == token_ids and self.salt == salt


class _Block:
    __slots__ = ("block_id", "ref_cnt", "entry")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.entry: _CacheEntry | None = None


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int  # usable blocks (the null block excluded)
    num_free_blocks: int
    usage: float
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of which found in the cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out KV blocks to requests and shares full blocks between requests with a common prefix."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}.")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Blocks with ref_cnt 0, least recently freed first. OrderedDict: O(1) pop-front and remove-by-id.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, _CacheEntry] = {}  # hash value -> entry

        self._tables: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[int]] = {}  # hash values of a request's full blocks, so far
        self._req_entries: dict[str, list[_CacheEntry | None]] = {}  # entry per processed full block

        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): what a new allocation can draw from."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_usable_blocks,
            num_free_blocks=self.num_free_blocks,
            usage=self.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's blocks, in position order. The live list: read it, don't mutate it."""
        return self._tables.get(request_id, [])

    def ref_cnt(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next to be reused first)."""
        return list(self._free)

    def is_cached(self, block_id: int) -> bool:
        return self._blocks[block_id].entry is not None

    def caching_enabled_for(self, request: Request) -> bool:
        """A salt turns caching on for one request: the samples of an n>1 request share their prompt."""
        return self.enable_prefix_caching or request.cache_salt is not None

    # ---- prefix cache lookup -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet: (block ids, number of tokens).

        At most `num_tokens - 1` tokens, in whole blocks, so the step still computes the last token and
        samples from it. Does not touch the blocks; pass them to `allocate_slots`.
        """
        if not self.caching_enabled_for(request) or request.request_id in self._tables:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        bs, tokens, salt = self.block_size, request.all_token_ids, request.cache_salt
        block_ids: list[int] = []
        parent: _CacheEntry | None = None
        for i in range(max_blocks):
            entry = self._cached.get(hashes[i])
            if entry is None or not entry.matches(tuple(tokens[i * bs : (i + 1) * bs]), salt, parent):
                break
            block_ids.append(self._pick_block(entry))
            parent = entry
        return block_ids, len(block_ids) * bs

    def _pick_block(self, entry: _CacheEntry) -> int:
        """Prefer a copy already in use, so the hit does not take a block off the free queue."""
        for block_id in entry.block_ids:
            if self._blocks[block_id].ref_cnt > 0:
                return block_id
        return entry.block_ids[0]

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Hash values of the request's first `num_blocks` full blocks, extended incrementally."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs, tokens, salt = self.block_size, request.all_token_ids, request.cache_salt
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs]), salt))
        return hashes

    # ---- allocation ----------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make the request's table cover num_computed_tokens + hit + num_new_tokens positions.

        `computed_blocks` (from `get_computed_blocks`, only when the request holds no blocks) are shared
        first. Returns False and changes nothing when the free pool is too small.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is not None and not computed_blocks:
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size:
                # Fast path (most decode steps): the held blocks already cover the new tokens.
                if self.caching_enabled_for(request):
                    self._register_full_blocks(request, min(total, request.num_tokens) // self.block_size)
                return True
        computed = computed_blocks or []
        admitting = table is None
        if computed and not admitting:
            raise ValueError(f"request {rid!r} already holds blocks; computed_blocks only at admission.")
        num_held = (len(table) if table else 0) + len(computed)
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_fresh = max(0, _cdiv(total, self.block_size) - num_held)
        num_revived = sum(1 for b in computed if self._blocks[b].ref_cnt == 0)
        if num_fresh + num_revived > len(self._free):
            return False

        if table is None:
            table = self._tables[rid] = []
        for block_id in computed:
            self._touch(block_id)
            table.append(block_id)
        for _ in range(num_fresh):
            table.append(self._pop_free_block())

        if self.caching_enabled_for(request):
            if admitting:
                self._req_entries[rid] = [self._blocks[b].entry for b in computed]
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed) * self.block_size
            # Register blocks as soon as their tokens are known: a sibling scheduled later in this step
            # may hit them (the runner writes a layer's KV before attention reads it).
            self._register_full_blocks(request, min(total, request.num_tokens) // self.block_size)
        return True

    def _touch(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.entry is not None:  # evict: the content is about to be overwritten
            entry = block.entry
            entry.block_ids.remove(block_id)
            if not entry.block_ids and self._cached.get(entry.hash_value) is entry:
                del self._cached[entry.hash_value]
            block.entry = None
        block.ref_cnt = 1
        return block_id

    def _register_full_blocks(self, request: Request, num_full: int) -> None:
        rid = request.request_id
        entries = self._req_entries.setdefault(rid, [])
        if len(entries) >= num_full:
            return
        table = self._tables[rid]
        hashes = self._block_hashes(request, num_full)
        bs, tokens, salt = self.block_size, request.all_token_ids, request.cache_salt
        for i in range(len(entries), num_full):
            parent = entries[i - 1] if i else None
            if i and parent is None:  # the chain is broken (a collision below): nothing to hang this on
                entries.append(None)
                continue
            token_ids = tuple(tokens[i * bs : (i + 1) * bs])
            block = self._blocks[table[i]]
            entry = self._cached.get(hashes[i])
            if entry is None:
                entry = self._cached[hashes[i]] = _CacheEntry(hashes[i], token_ids, salt, parent)
            elif not entry.matches(token_ids, salt, parent):
                entries.append(None)  # a true hash collision: keep the resident entry, cache nothing
                continue
            if block.entry is None:
                entry.block_ids.append(block.block_id)
                block.entry = entry
            entries.append(entry)

    # ---- release -------------------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Drop the request's blocks (finished, aborted or preempted). Cached blocks stay reusable.

        Blocks are released tail first, so a request's last blocks are evicted before its first ones;
        blocks holding no cached content go to the front of the queue: they are worth nothing.
        """
        rid = request.request_id
        self._req_hashes.pop(rid, None)
        self._req_entries.pop(rid, None)
        for block_id in reversed(self._tables.pop(rid, [])):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.entry is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content. Only when no block is in use (else returns False), like vLLM."""
        if len(self._free) != self.num_usable_blocks:
            return False
        self._cached.clear()
        for block in self._blocks:
            block.entry = None
        return True
