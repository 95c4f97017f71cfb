"""Two defects of xgrammar 0.2.8's grammars, which ringllm repairs or refuses before serving them.

Strict JSON strings: xgrammar writes a string's characters raw where a schema bounds it (minLength,
maxLength, pattern, format), and lets through what JSON must escape: control characters, and for
patterns and some formats `"` and `\\` too. `Layout.restrict_json_strings` takes those characters out
of such strings (a value that needs them cannot be generated; a string that needs nothing else then
admits no output); a pattern becomes the rules of its regex for that.

Grammars that admit nothing: xgrammar builds them without a word (a rule that refers only to
itself, an empty character class), and their masks would allow no token. `Layout.dead_rule` finds a
rule the output can reach but never finish: a rule finishes if its body can, a sequence if all its
parts can, a choice if one can, a repetition if it may repeat zero times or its rule can, a
character class if it holds a character, a pattern if its regex can; literals, starred classes and
tag dispatches (free text) always can.

Both read the grammar's serialized form, in the layout xgrammar 0.2.8 writes ("v16"); `Layout.parse`
gives None for another, and then neither runs (the engine still ends a request that meets a dead end).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import orjson

SERIALIZED_VERSION = "v16"
# expression types, serialized as [type, operand count, operands...]
BYTES, CLASS, CLASS_STAR, EMPTY, RULE, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)
REGEX = 12
MAX_CODEPOINT = 0x10FFFF
QUOTE = [BYTES, 1, ord('"')]
# what a JSON string cannot hold raw: control characters, the quote and the backslash
ESCAPED = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
NOTHING = [CLASS, 3, 1, 0, MAX_CODEPOINT]  # a class of no character
# a rule's fields after its name and body, as a regex's rules have them (no lookahead)
PLAIN_RULE = [-1, False, -1, -1, "", False, None]


class Layout:
    """A serialized grammar's rules and expressions, as lists to read and edit."""

    def __init__(self, grammar: dict[str, Any]) -> None:
        self.grammar, self.rules = grammar, grammar["rules"]
        data, starts = grammar["grammar_expr_data"], grammar["grammar_expr_indptr"]
        self.exprs = [data[start:end] for start, end in zip(starts, [*starts[1:], len(data)])]

    @classmethod
    def parse(cls, serialized: str) -> Layout | None:
        grammar = orjson.loads(serialized)
        return cls(grammar) if grammar.get("__VERSION__") == SERIALIZED_VERSION else None

    def dumps(self) -> str:
        data, starts = [], []
        for expr in self.exprs:
            starts.append(len(data))
            data += expr
        self.grammar["grammar_expr_data"], self.grammar["grammar_expr_indptr"] = data, starts
        return orjson.dumps(self.grammar).decode()

    def restrict_json_strings(self) -> Layout:
        """The grammar, with every string it spells between quotes, character by character, kept to what
        JSON holds raw. (A plain string's rule, `"` then its own escaping rule, is correct already.) The
        edited layout goes through xgrammar's printer and parser, so xgrammar compiles only what it wrote."""
        import xgrammar as xgr

        todo = [e for expr in self.exprs if expr[0] == SEQUENCE and expr[1] >= 3 for e in self._quoted(expr[2:])]
        if not todo:
            return self
        seen, seen_rules = set(), set()
        while todo:
            if (e := todo.pop()) in seen:
                continue
            seen.add(e)
            kind, args = self.exprs[e][0], self.exprs[e][2:]
            if kind == REGEX and (root := self._merge_regex(bytes(args[1:]))) is not None:
                self.exprs += [[RULE, 1, root], [SEQUENCE, 1, len(self.exprs)]]  # a rule's body in normal form: ((root))
                self.exprs[e] = [CHOICES, 1, len(self.exprs) - 1]
                kind, args = CHOICES, [len(self.exprs) - 1]
            if kind in (SEQUENCE, CHOICES):
                todo += args
            elif kind in (RULE, REPEAT) and args[0] not in seen_rules:
                seen_rules.add(args[0])
                todo.append(self.rules[args[0]][1])
            elif kind in (BYTES, CLASS, CLASS_STAR):
                self.exprs[e] = _unescaped(self.exprs[e])
        text, root = str(xgr.Grammar.deserialize_json(self.dumps())), self.rules[self.grammar["root_rule_id"]][0]
        return Layout(orjson.loads(xgr.Grammar.from_ebnf(text, root_rule_name=root).serialize_json()))

    def _quoted(self, parts: list[int]) -> list[int]:
        """The parts between a sequence's opening and closing quote, if it has them."""
        return parts[1:-1] if self.exprs[parts[0]] == QUOTE and self.exprs[parts[-1]] == QUOTE else []

    def _merge_regex(self, pattern: bytes) -> int | None:
        """Appends the rules of `pattern`'s regex and returns its root's, or None if it cannot be read."""
        import xgrammar as xgr

        try:
            regex = Layout.parse(xgr.Grammar.from_regex(pattern.decode()).serialize_json())
        except (RuntimeError, ValueError):
            return None
        if regex is None or any(rule[2:] != PLAIN_RULE for rule in regex.rules):
            return None
        rule_base, expr_base = len(self.rules), len(self.exprs)
        exprs = []
        for expr in regex.exprs:
            kind, args = expr[0], expr[2:]
            if kind in (SEQUENCE, CHOICES):
                args = [a + expr_base for a in args]
            elif kind in (RULE, REPEAT):
                args = [args[0] + rule_base, *args[1:]]
            elif kind not in (BYTES, CLASS, CLASS_STAR, EMPTY):
                return None
            exprs.append([kind, len(args), *args])
        self.exprs += exprs
        self.rules += [[f"pattern_{rule_base}_{name}", body + expr_base, *PLAIN_RULE] for name, body, *_ in regex.rules]
        return regex.grammar["root_rule_id"] + rule_base

    def dead_rule(self) -> str | None:
        """The name of a rule reachable from the root that no text can finish, if there is one."""
        finishes = [False] * len(self.rules)

        def can_finish(e: int) -> bool:
            kind, args = self.exprs[e][0], self.exprs[e][2:]
            if kind == CLASS:
                return _holds_a_character(bool(args[0]), args[1:])
            if kind == RULE:
                return finishes[args[0]]
            if kind == SEQUENCE:
                return all(can_finish(a) for a in args)
            if kind == CHOICES:
                return any(can_finish(a) for a in args)
            if kind == REPEAT:
                return args[1] == 0 or finishes[args[0]]
            if kind == REGEX:  # its flag, then the regex's UTF-8 bytes
                return _regex_admits(bytes(args[1:]))
            return True

        refs = [self._rules_in(rule[1]) for rule in self.rules]
        order = _after_their_rules(refs, range(len(self.rules)))
        changed = True
        while changed:  # a rule comes after those it refers to: only cycles take another pass
            changed = False
            for rule in order:
                if not finishes[rule] and can_finish(self.rules[rule][1]):
                    finishes[rule] = changed = True
        dead = (rule for rule in _after_their_rules(refs, [self.grammar["root_rule_id"]]) if not finishes[rule])
        return next((self.rules[rule][0] for rule in dead), None)

    def _rules_in(self, body: int) -> list[int]:
        """The rules an expression refers to (lookaheads aside)."""
        todo, rules = [body], []
        for e in todo:
            kind, args = self.exprs[e][0], self.exprs[e][2:]
            if kind in (SEQUENCE, CHOICES):
                todo += args
            elif kind in (RULE, REPEAT):
                rules.append(args[0])
            elif kind == TAG_DISPATCH:  # (tag, rule) pairs, then the loop flag and the excluded strings
                rules += args[1:-2:2]
        return rules


def _unescaped(expr: list[int]) -> list[int]:
    """A literal or character class without the characters JSON escapes (no character: NOTHING)."""
    kind, args = expr[0], expr[2:]
    if kind == BYTES:
        return NOTHING if any(low <= b <= high for b in args for low, high in ESCAPED) else expr
    negated, bounds = args[0], args[1:]
    if negated:
        ranges = [*zip(bounds[::2], bounds[1::2]), *ESCAPED]
    else:
        ranges = [piece for low, high in zip(bounds[::2], bounds[1::2]) for piece in _without_escaped(low, high)]
        if not ranges:
            return NOTHING if kind == CLASS else [EMPTY, 0]
    flat = [bound for pair in ranges for bound in pair]
    return [kind, len(flat) + 1, negated, *flat]


def _without_escaped(low: int, high: int) -> list[tuple[int, int]]:
    pieces = []
    for skip_low, skip_high in ESCAPED:
        if low <= min(high, skip_low - 1):
            pieces.append((low, min(high, skip_low - 1)))
        low = max(low, skip_high + 1)
    return [*pieces, (low, high)] if low <= high else pieces


def _holds_a_character(negated: bool, bounds: list[int]) -> bool:
    ranges = sorted(zip(bounds[::2], bounds[1::2]))
    if not negated:
        return any(low <= high for low, high in ranges)
    covered = -1  # every code point up to here is excluded
    for low, high in ranges:
        if low > covered + 1:
            return True
        covered = max(covered, high)
    return covered < MAX_CODEPOINT


def _after_their_rules(refs: list[list[int]], roots: Iterable[int]) -> list[int]:
    """The rules reachable from `roots`, each after the rules it refers to (but in a cycle)."""
    seen, order = set(), []
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(refs[root]))]
        while stack:
            rule, pending = stack[-1]
            ref = next((r for r in pending if r not in seen), None)
            if ref is None:
                order.append(rule)
                stack.pop()
            else:
                seen.add(ref)
                stack.append((ref, iter(refs[ref])))
    return order


@functools.lru_cache(maxsize=256)
def _regex_admits(pattern: bytes) -> bool:
    """Can the regex match anything? Yes too where xgrammar reads it only inside a JSON string."""
    import xgrammar as xgr

    try:
        regex = Layout.parse(xgr.Grammar.from_regex(pattern.decode()).serialize_json())
    except (RuntimeError, ValueError):
        return True
    return regex is None or regex.dead_rule() is None
