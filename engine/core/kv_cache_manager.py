"""Per-request block tables on top of the block pool: allocation for the tokens a step will compute, prefix-cache
lookups, freeing, and swapping a preempted request's blocks to and from the CPU swap pool."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0      # prompt tokens looked up
    hits: int = 0         # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class RequestBlocks:
    """Everything the KV cache manager keeps about one request, from its first allocation until it is freed."""
    blocks: list[KVCacheBlock] = field(default_factory=list)     # its block table, in token order (on the GPU)
    block_ids: list[int] = field(default_factory=list)           # the same as ids: the block table a step carries
    cpu_block_ids: list[int] = field(default_factory=list)       # while swapped out: where its blocks wait
    num_cached_blocks: int = 0                                    # leading blocks registered in the prefix cache

    def set_blocks(self, blocks: list[KVCacheBlock]) -> None:
        # A new id list rather than an in-place edit: a SchedulerOutput already handed out keeps its table.
        self.blocks = blocks
        self.block_ids = [b.block_id for b in blocks]


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_gpu_blocks, enable_caching)
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.requests: dict[str, RequestBlocks] = {}       # request id -> its record, while it holds blocks
        self.prefix_stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_blocks)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (physical block ids in order)."""
        record = self.requests.get(request_id)
        return record.block_ids if record is not None else []

    # ---- prefix cache --------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks at the start of the request, and the tokens they cover.
        Never the block holding the last token: that token must be computed to produce logits."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0          # prompt logprobs need the logits of every prompt token (as vLLM)
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        # Counted once per request: a request that does not fit is looked up again at every step until it does,
        # and counting each attempt would weigh the hit rate by how long requests waited.
        if not request.prefix_cache_counted:
            request.prefix_cache_counted = True
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cache_computed_blocks(self, request: Request) -> None:
        """After a step: register the request's full blocks whose KV is now computed."""
        record = self.requests.get(request.request_id)
        if not self.enable_caching or record is None or not record.blocks:
            return
        request.update_block_hashes(self.block_size)
        # Full blocks whose token ids are all on the host (a pending token, see PendingTokens, cannot be hashed
        # yet). Their KV may still be in flight on the device; any request that hits them runs in a later step
        # on the same stream, after the writes.
        num_full = min(request.num_computed_tokens // self.block_size, len(record.blocks),
                       len(request.block_hashes))
        for i in range(record.num_cached_blocks, num_full):
            self.pool.cache_block(record.blocks[i], request.block_hashes[i])
        record.num_cached_blocks = max(record.num_cached_blocks, num_full)

    # ---- allocation ----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus cached blocks the request
        takes over). False, changing nothing, when the pool has too few free blocks."""
        record = self.requests.get(request.request_id)
        if record is not None and record.blocks and not new_computed_blocks and \
                request.num_computed_tokens + num_new_tokens <= len(record.blocks) * self.block_size:
            return True                                    # the common decode step: room in the last block
        blocks = record.blocks if record is not None else []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cached blocks sitting in the free queue stop being free once taken.
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) > self.pool.num_free_blocks - reclaimed:
            return False
        if record is None:
            record = self.requests[request.request_id] = RequestBlocks()
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(needed) if needed > 0 else []
        record.set_blocks(blocks + list(new_computed_blocks) + new_blocks)
        if new_computed_blocks:
            record.num_cached_blocks = len(record.blocks) - len(new_blocks)
        return True

    def free(self, request: Request) -> None:
        """Release every block (GPU and CPU) of a finished or recompute-preempted request. Tail blocks go to
        the free queue first so that shared prefixes are evicted last."""
        record = self.requests.pop(request.request_id, None)
        if record is None:
            return
        self.pool.free_blocks(reversed(record.blocks))
        self.free_cpu_blocks.extend(record.cpu_block_ids)

    # ---- swap space ----------------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        record = self.requests.get(request.request_id)
        n = len(record.blocks) if record is not None else 0
        return 0 < n <= len(self.free_cpu_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to CPU blocks; returns (gpu_block, cpu_block) copies to run before the
        GPU blocks are reused. The GPU blocks keep their hashes, so they stay prefix-cache hits until reused."""
        record = self.requests[request.request_id]
        blocks = record.blocks
        record.cpu_block_ids = [self.free_cpu_blocks.pop() for _ in blocks]
        record.set_blocks([])
        record.num_cached_blocks = 0
        self.pool.free_blocks(reversed(blocks))
        return [(b.block_id, c) for b, c in zip(blocks, record.cpu_block_ids)]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        record = self.requests.get(request.request_id)
        num_cpu = len(record.cpu_block_ids) if record is not None else 0
        needed = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size), num_cpu)
        return needed <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back into fresh GPU blocks; returns (cpu_block, gpu_block) copies."""
        record = self.requests[request.request_id]
        cpu, record.cpu_block_ids = record.cpu_block_ids, []
        record.set_blocks(self.pool.get_new_blocks(len(cpu)))
        self.free_cpu_blocks.extend(cpu)
        return [(c, b.block_id) for c, b in zip(cpu, record.blocks)]

    # ---- read-only view for the page's block map (engine/kv_map.py) ----------------------------------------
    def block_owners(self) -> tuple[dict[str, list[int]], list[int], dict[str, int]]:
        """(request id -> GPU block ids, the free blocks that still hold a prefix-cache hash, request id -> CPU
        blocks held while swapped out), copied between two steps on the engine thread (the map is built from the
        copies). Walks what requests and the prefix cache hold, not every block of the pool."""
        records = list(self.requests.items())
        tables = {rid: list(r.block_ids) for rid, r in records if not r.cpu_block_ids}
        cached_free = [b.block_id for b in list(self.pool.cached.values()) if b.ref_cnt == 0]
        swapped = {rid: len(r.cpu_block_ids) for rid, r in records if r.cpu_block_ids}
        return tables, cached_free, swapped
