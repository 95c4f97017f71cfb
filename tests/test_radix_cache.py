"""The page allocator and the radix prefix cache: insert, match, split, evict and lock."""

from __future__ import annotations

import pytest

from runtime.scheduler.pages import PageAllocator
from runtime.scheduler.radix_cache import RadixCache

PAGE = 2


def fresh(num_pages: int = 32) -> tuple[PageAllocator, RadixCache]:
    allocator = PageAllocator(num_pages)
    return allocator, RadixCache(allocator, PAGE)


def cached(cache: RadixCache, allocator: PageAllocator, tokens: list[int]) -> list[int]:
    """Insert `tokens` as a finished request would: fresh pages for every whole page."""
    pages = allocator.alloc(len(tokens) // PAGE)
    cache.insert(tokens[: len(pages) * PAGE], pages)
    return pages


def test_allocator_hands_out_each_page_once_and_catches_double_free():
    allocator = PageAllocator(4)
    pages = allocator.alloc(3)
    assert sorted(pages) == [0, 1, 2] and allocator.num_free == 1
    assert allocator.alloc(2) is None  # all or nothing
    allocator.free(pages)
    assert allocator.num_free == 4
    with pytest.raises(RuntimeError):
        allocator.free([pages[0]])


def test_match_is_page_aligned():
    allocator, cache = fresh()
    pages = cached(cache, allocator, [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6, 7])[0] == pages
    assert cache.match([1, 2, 3, 9])[0] == pages[:1]  # [3, 9] is not a cached page
    assert cache.match([1, 2, 3])[0] == pages[:1]  # a partial last page never matches
    assert cache.match([9, 9])[0] == []


def test_insert_splits_a_node_and_frees_duplicate_pages():
    allocator, cache = fresh()
    first = cached(cache, allocator, [1, 2, 3, 4, 5, 6])
    second = cached(cache, allocator, [1, 2, 3, 4, 7, 8])  # shares two pages, then parts
    assert cache.cached_pages == 4  # the shared pages are kept once
    assert allocator.num_free == 32 - 4  # the duplicates of the shared pages were freed
    assert cache.match([1, 2, 3, 4, 7, 8])[0] == first[:2] + second[2:]
    node = cache.match([1, 2, 3, 4])[1]
    assert node.tokens == (1, 2, 3, 4) and len(node.children) == 2  # the split point


def test_a_salt_matches_only_what_was_cached_under_it_and_its_tree_goes_when_evicted():
    allocator, cache = fresh()
    shared = cached(cache, allocator, [1, 2, 3, 4])
    pages = allocator.alloc(2)
    assert cache.insert([1, 2, 3, 4], pages, salt="a") == 0  # the shared tree's copy is not this salt's
    assert cache.match([1, 2, 3, 4, 5], salt="a")[0] == pages
    assert cache.match([1, 2, 3, 4, 5], salt="b")[0] == []  # another salt finds nothing
    assert cache.match([1, 2, 3, 4, 5])[0] == shared  # nor does the salt leak into the shared tree
    node = cache.match([1, 2, 3, 4], salt="a")[1]
    cache.lock(node)
    assert cache.flush() == 2 and cache.salted  # the locked salted pages stay
    cache.unlock(node)
    assert cache.flush() == 2 and not cache.salted and allocator.num_free == 32
    assert cache.match([1, 2, 3, 4], salt="a")[0] == []


def test_reinserting_the_cached_pages_frees_nothing():
    allocator, cache = fresh()
    pages = cached(cache, allocator, [1, 2, 3, 4])
    assert cache.insert([1, 2, 3, 4], pages) == 4
    assert allocator.num_free == 30 and cache.cached_pages == 2


def test_evict_takes_least_recently_used_unlocked_leaves():
    allocator, cache = fresh()
    cached(cache, allocator, [1, 1, 1, 1])
    cached(cache, allocator, [2, 2, 2, 2])
    cache.match([1, 1, 1, 1])  # touch: [2, 2, ...] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match([2, 2, 2, 2])[0] == [] and len(cache.match([1, 1, 1, 1])[0]) == 2


def test_locked_prefix_survives_eviction_until_unlocked():
    allocator, cache = fresh()
    cached(cache, allocator, [1, 2, 3, 4])
    node = cache.match([1, 2, 3, 4]).node
    cache.lock(node)
    assert cache.evictable_pages() == 0 and cache.evict(10) == 0
    cache.unlock(node)
    assert cache.evictable_pages() == 2 and cache.flush() == 2
    assert allocator.num_free == allocator.num_pages


def test_lock_survives_a_split_below_it():
    allocator, cache = fresh()
    cached(cache, allocator, [1, 2, 3, 4])
    node = cache.match([1, 2, 3, 4]).node
    cache.lock(node)
    cached(cache, allocator, [1, 2, 9, 9])  # splits the locked node after its first page
    cache.flush()
    assert cache.match([1, 2, 3, 4])[0] != []  # still cached: the lock covered both halves
    cache.unlock(node)
    cache.flush()
    assert allocator.num_free == allocator.num_pages


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-cache"])
def test_a_new_scheduler_adopts_the_kv_an_engine_kept_and_replays_take_it_back(prefix_cache):
    """Two requests that shared a prompt page, one replayed with a token its engine never fed, one whose
    replay never comes: the replays start where the pool's KV ends, and nothing is left over."""
    from runtime.config import EngineConfig
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.scheduler import Scheduler

    config = EngineConfig(page_size=4, enable_prefix_cache=prefix_cache, max_prefill_tokens=64)
    scheduler = Scheduler(config, num_pages=16, eos_token_ids=(0,), max_position=256)
    shared = [11, 12, 13, 14]
    held = [  # the engine's slots as Engine.reset reports them: rid, tokens with KV in the pool, their pages, salt
        (1, [*shared, 21, 22, 23, 24, 25, 26], [3, 5, 6], None),
        (2, [*shared, 31, 32], [3, 7], None) if prefix_cache else (2, [*shared, 31, 32], [4, 7], None),
        (3, [41, 42, 43, 44, 45], [8, 9], None),  # its request ended before its replay came
    ]
    scheduler.adopt(held)
    assert scheduler.allocator.num_free == 16 - (6 if prefix_cache else 7)
    params = SamplingParams(max_tokens=4, temperature=0)
    scheduler.add(1, [*shared, 21, 22], params, generated=[23, 24, 25, 26, 27])  # 27 was drawn, never fed
    scheduler.add(2, [*shared, 31], params, generated=[32])
    plan = scheduler.schedule()
    opened = {new.slot: new.cached for new in plan.new_slots}
    chunks = {chunk.slot: chunk.token_ids for chunk in plan.chunks}
    first, second = (scheduler.running[i] for i in (0, 1))
    assert opened[first.slot] == 10 and chunks[first.slot] == [27]  # only the token its engine never saw is fed
    assert opened[second.slot] == 5 and chunks[second.slot] == [32]
    assert first.pages == [3, 5, 6] and second.pages[:2] == ([3, 7] if prefix_cache else [4, 7])
    scheduler.release_adopted()  # the third's replay never came: its pages go back
    for request in list(scheduler.running):
        scheduler.abort(request.rid)
    scheduler.flush_cache()
    assert scheduler.allocator.num_free == 16 and not scheduler.adopted
