"""Data-parallel placement: which replica takes a request.

- `cache_aware` (sglang-router's policy): the replica whose prefix cache most likely holds the longest
  prefix of the prompt, unless its load exceeds the least-loaded live replica's by more than `balance`
  requests; a prompt no replica has seen goes to the least loaded.
- `round_robin`: live replicas in turn.
- `least_load`: the live replica with the fewest running and waiting requests.

The router's view of each cache is its own record of the prompts it sent there, as chained hashes of
BLOCK-token blocks, the least recently matched forgotten first. Torch-free, like the scheduler."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

POLICIES = ("cache_aware", "round_robin", "least_load")
BLOCK = 16


def block_keys(prompt: Sequence[int], salt: str | None = None) -> list[int]:
    """One key per whole block, each naming the block, everything before it and the cache salt."""
    keys, key = [], hash(salt)
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        key = hash((key, tuple(prompt[start : start + BLOCK])))
        keys.append(key)
    return keys


class Router:
    def __init__(self, replicas: int, policy: str = "cache_aware", balance: int = 32, remembered_blocks: int = 1 << 16) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        self.policy, self.balance, self.capacity = policy, balance, remembered_blocks
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.turn = 0

    def place(self, prompt: Sequence[int], loads: Sequence[int], live: Sequence[bool], salt: str | None = None) -> int:
        """The replica for `prompt` (under its cache salt), given each replica's load and whether it can serve now (all down:
        any replica, whose scheduler holds the request until its engines are back)."""
        candidates = [r for r, up in enumerate(live) if up] or list(range(len(live)))
        self.turn += 1
        if self.policy == "round_robin":
            return candidates[self.turn % len(candidates)]
        lightest = min(loads[r] for r in candidates)
        least = [r for r in candidates if loads[r] == lightest]
        choice = least[self.turn % len(least)]  # ties in turn, so a burst before the gauges move still spreads
        if self.policy == "cache_aware":
            keys = block_keys(prompt, salt)
            matched = {r: self._matched(r, keys) for r in candidates}
            best = max(candidates, key=lambda r: (matched[r], -loads[r]))
            if matched[best] and loads[best] - lightest <= self.balance:
                choice = best
            self._remember(choice, keys)
        return choice

    def _matched(self, replica: int, keys: list[int]) -> int:
        seen, count = self.seen[replica], 0
        for key in keys:
            if key not in seen:
                break
            seen.move_to_end(key)
            count += 1
        return count

    def _remember(self, replica: int, keys: list[int]) -> None:
        seen = self.seen[replica]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
