"""Unit tests for the torch-free paged KV cache manager."""

from __future__ import annotations

import pytest

from qwick.core import kv_cache_manager as kvm
from qwick.core.kv_cache_manager import KVCacheManager
from qwick.core.request import Request
from qwick.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def admit(mgr: KVCacheManager, req: Request, num_tokens: int | None = None) -> int:
    """What the scheduler does on admission: look up, allocate, mark the hit as computed."""
    blocks, hit = mgr.get_computed_blocks(req)
    num_new = (req.num_tokens if num_tokens is None else num_tokens) - hit
    assert mgr.allocate_slots(req, num_new, blocks)
    req.num_computed_tokens = hit
    return hit


def snapshot(mgr: KVCacheManager) -> tuple:
    return (
        {rid: list(t) for rid, t in mgr._tables.items()},
        mgr.free_block_ids(),
        [mgr.ref_cnt(b) for b in range(mgr.num_blocks)],
        mgr.prefix_cache_queries,
        mgr.prefix_cache_hits,
    )


def test_allocate_and_free_never_hands_out_block_zero():
    mgr = KVCacheManager(num_blocks=5, block_size=BS, enable_prefix_caching=False)
    assert mgr.num_free_blocks == 4 and mgr.usage == 0.0
    a, b = make_req("a", list(range(9))), make_req("b", [1])
    assert mgr.allocate_slots(a, 9)  # 3 blocks
    assert mgr.allocate_slots(b, 1)  # 1 block
    assert sorted(mgr.get_block_table("a") + mgr.get_block_table("b")) == [1, 2, 3, 4]
    assert mgr.num_free_blocks == 0 and mgr.usage == 1.0
    assert not mgr.allocate_slots(make_req("c", [1]), 1)
    mgr.free(a)
    assert mgr.num_free_blocks == 3 and mgr.usage == pytest.approx(0.25)
    assert mgr.get_block_table("a") == []
    mgr.free(b)
    assert mgr.num_free_blocks == 4 and 0 not in mgr.free_block_ids()


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(8)))
    admit(mgr, a)
    b = make_req("b", list(range(8)) + [50, 51, 52, 53, 54])  # hits a's 2 blocks, needs 2 more
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 8 and mgr.num_free_blocks == 1
    before = snapshot(mgr)
    assert not mgr.allocate_slots(b, b.num_tokens - hit, blocks)
    assert snapshot(mgr) == before


def test_incremental_growth_during_decode():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    r = make_req("r", [1, 2, 3])
    assert mgr.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    assert len(mgr.get_block_table("r")) == 1
    for tok in range(4, 10):
        r.append_output_token(tok)
        assert mgr.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert len(mgr.get_block_table("r")) == -(-r.num_computed_tokens // BS)


def test_shared_prefix_ref_counts():
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(10)))
    admit(mgr, a)
    b = make_req("b", list(range(8)) + [77, 78, 79])
    assert admit(mgr, b) == 8
    ta, tb = mgr.get_block_table("a"), mgr.get_block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [mgr.ref_cnt(x) for x in ta] == [2, 2, 1]
    mgr.free(a)
    assert [mgr.ref_cnt(x) for x in tb] == [1, 1, 1]
    assert not set(tb) & set(mgr.free_block_ids())
    mgr.free(b)
    assert mgr.num_free_blocks == 9
    assert all(mgr.ref_cnt(x) == 0 for x in range(10))


def test_hit_is_capped_to_leave_one_token():
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_req("a", prompt)
    admit(mgr, a)
    blocks, hit = mgr.get_computed_blocks(make_req("b", prompt))
    assert hit == 8 and blocks == mgr.get_block_table("a")[:2]
    blocks, hit = mgr.get_computed_blocks(make_req("c", prompt + [99]))
    assert hit == 12 and blocks == mgr.get_block_table("a")
    assert mgr.get_computed_blocks(make_req("d", prompt[:1])) == ([], 0)


def test_blocks_registered_at_allocation_time():
    """A sibling scheduled later in the same step hits blocks whose KV this step computes."""
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(13))
    a = make_req("a", prompt)
    assert mgr.allocate_slots(a, 6)  # a chunk: only the first block is full
    assert mgr.get_computed_blocks(make_req("b", prompt))[1] == 4
    a.num_computed_tokens = 6
    assert mgr.allocate_slots(a, 7)  # the rest of the prompt
    assert mgr.get_computed_blocks(make_req("c", prompt))[1] == 12


def test_decode_tokens_fill_blocks_that_get_cached():
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7])
    admit(mgr, a)
    a.num_computed_tokens = 7
    a.append_output_token(8)
    assert mgr.allocate_slots(a, 1)  # position 7 fills the second block
    follow_up = make_req("b", a.all_token_ids + [9])
    assert mgr.get_computed_blocks(follow_up) == (mgr.get_block_table("a")[:2], 8)


def test_lru_eviction_order():
    """Least recently freed first, a request's tail before its head, uncached blocks before all."""
    mgr = KVCacheManager(num_blocks=7, block_size=BS, enable_prefix_caching=True)
    r1 = make_req("r1", [1] * 4 + [2] * 4 + [3])
    r2 = make_req("r2", [4] * 4 + [5] * 4 + [6])
    admit(mgr, r1)
    admit(mgr, r2)
    t1, t2 = list(mgr.get_block_table("r1")), list(mgr.get_block_table("r2"))
    mgr.free(r1)
    mgr.free(r2)
    assert mgr.free_block_ids() == [t2[2], t1[2], t1[1], t1[0], t2[1], t2[0]]
    assert mgr.is_cached(t1[1]) and not mgr.is_cached(t1[2])
    # Three fresh blocks: the two uncached ones, then r1's tail.
    admit(mgr, make_req("r3", [7] * 9))
    assert not mgr.is_cached(t1[1])
    assert mgr.get_computed_blocks(make_req("q1", r1.prompt_token_ids)) == ([t1[0]], 4)
    assert mgr.get_computed_blocks(make_req("q2", r2.prompt_token_ids)) == (t2[:2], 8)


def test_hit_takes_block_off_free_queue_and_refreshes_it():
    mgr = KVCacheManager(num_blocks=7, block_size=BS, enable_prefix_caching=True)
    r1 = make_req("r1", [1] * 4 + [9])
    r2 = make_req("r2", [2] * 4 + [9])
    admit(mgr, r1)
    admit(mgr, r2)
    b1, b2 = mgr.get_block_table("r1")[0], mgr.get_block_table("r2")[0]
    mgr.free(r1)
    mgr.free(r2)
    assert mgr.free_block_ids()[-2:] == [b1, b2]
    again = make_req("again", [1] * 4 + [8])
    admit(mgr, again)
    assert mgr.ref_cnt(b1) == 1 and b1 not in mgr.free_block_ids()
    mgr.free(again)
    assert mgr.free_block_ids()[-2:] == [b2, b1]  # b1 is now the most recently freed


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens, salt: 42)
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(mgr, a)
    mgr.free(a)
    assert mgr.get_computed_blocks(make_req("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == ([], 0)
    # Only the first block could be registered: every later one collides with it.
    blocks, hit = mgr.get_computed_blocks(make_req("c", a.prompt_token_ids))
    assert hit == 4


def test_collision_through_parent_is_not_a_hit(monkeypatch):
    """With a hash blind to the parent, equal second blocks after different first blocks collide.
    Comparing tokens alone would then serve a block whose KV was computed after another prefix."""
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens, salt: hash((tokens, salt)))
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    x = [5, 6, 7, 8]
    r1 = make_req("r1", [1, 1, 1, 1] + x + [0])
    r2 = make_req("r2", [2, 2, 2, 2] + x + [0])
    admit(mgr, r1)
    admit(mgr, r2)
    q = make_req("q", r2.prompt_token_ids)
    blocks, hit = mgr.get_computed_blocks(q)
    assert (blocks, hit) == (mgr.get_block_table("r2")[:1], 4)
    assert mgr.get_block_table("r1")[1] not in blocks


def test_cache_salt_separates_requests():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(9))
    admit(mgr, make_req("a", prompt, salt="alice"))
    assert mgr.get_computed_blocks(make_req("b", prompt, salt="bob")) == ([], 0)
    assert mgr.get_computed_blocks(make_req("c", prompt))[1] == 0
    assert mgr.get_computed_blocks(make_req("d", prompt, salt="alice"))[1] == 8


def test_n_samples_share_prompt_with_caching_off():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(10))
    s0, s1 = make_req("x-0", prompt, salt="x"), make_req("x-1", prompt, salt="x")
    admit(mgr, s0)
    assert admit(mgr, s1) == 8
    assert mgr.get_block_table("x-0")[:2] == mgr.get_block_table("x-1")[:2]
    # Requests without a salt neither register nor look up anything.
    plain = make_req("p", prompt)
    assert admit(mgr, plain) == 0
    assert mgr.get_computed_blocks(make_req("p2", prompt)) == ([], 0)
    assert mgr.num_free_blocks == 15 - 3 - 1 - 3


def test_duplicate_block_keeps_content_cached_after_original_is_evicted():
    """Two samples of an exact-k-block prompt each compute the last block; either copy serves a hit."""
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(8))
    s0, s1 = make_req("s0", prompt, salt="n"), make_req("s1", prompt, salt="n")
    admit(mgr, s0)
    assert admit(mgr, s1) == 4
    t0, t1 = list(mgr.get_block_table("s0")), list(mgr.get_block_table("s1"))
    assert t0[0] == t1[0] and t0[1] != t1[1]
    mgr.free(s0)  # t0[1] is now free and cached: the next fresh block evicts it
    admit(mgr, make_req("other", [99] * 3))
    assert not mgr.is_cached(t0[1])
    follow = make_req("f", prompt + [1], salt="n")
    assert mgr.get_computed_blocks(follow) == (t1[:2], 8)


def test_counters_and_reset():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(10))
    a = make_req("a", prompt)
    admit(mgr, a)
    b = make_req("b", prompt)
    admit(mgr, b)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)
    # Looking up without allocating does not count: the scheduler may look a request up many times.
    mgr.get_computed_blocks(make_req("c", prompt))
    assert mgr.stats.prefix_cache_queries == 20
    assert mgr.stats.num_free_blocks == 15 - 4
    assert mgr.stats.usage == pytest.approx(4 / 15)
    assert not mgr.reset_prefix_cache()  # blocks in use
    mgr.free(a)
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_req("d", prompt)) == ([], 0)
    assert not any(mgr.is_cached(x) for x in range(16))


def test_computed_blocks_only_at_admission():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(9)))
    admit(mgr, a)
    b = make_req("b", list(range(9)))
    admit(mgr, b)
    with pytest.raises(ValueError):
        mgr.allocate_slots(b, 1, mgr.get_block_table("a")[:1])
    assert mgr.get_computed_blocks(b) == ([], 0)  # already holds blocks


def test_rejects_tiny_pool():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=1, block_size=BS)
