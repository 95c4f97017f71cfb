"""Stop strings: the Aho-Corasick matcher against a brute-force check, its cost with many long stop
strings that nearly match, and the detokenizer's text through it (chunks, stop tokens, replays) with what
matched (the stop string, or the stop token)."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from actors.detokenizer import DetokenizerActor
from actors.frames import Announce, Detok, TokenItem
from runtime.text.stop_matcher import StopMatcher

STOPS = st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=5)


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where `text` is cut, and by which stop string: the one ending earliest, the longest among those ending together."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    end, start = min(found)
    return start, text[start:end]


def first_match(text: str, stops: list[str]) -> int | None:
    return None if (hit := first_stop(text, stops)) is None else hit[0]


def could_begin(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` are a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(stops=STOPS, pieces=st.lists(st.text(alphabet="abc", max_size=5), max_size=20))
def test_matcher_agrees_with_brute_force(stops: list[str], pieces: list[str]) -> None:
    matcher, text = StopMatcher(stops), ""
    for piece in pieces:
        start = matcher.feed(piece)
        cut = None if start is None else len(text) + start
        text += piece
        assert cut == first_match(text, stops)
        if cut is not None:
            assert cut >= len(text) - len(piece) - could_begin(text[: len(text) - len(piece)], stops)
            return
        assert matcher.held == could_begin(text, stops)


def test_matcher_picks_earliest_end_then_longest() -> None:
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == 1  # "bc" ends first
    assert StopMatcher(["c", "abc", "bc"]).feed("xabc") == 1  # all end together: the longest
    matcher = StopMatcher(["hello world"])
    assert matcher.feed("say hello wo") is None and matcher.held == len("hello wo")
    assert matcher.feed("rld!") == -len("hello wo")  # began in text fed before


# A tokenizer whose tokens decode to their own text, so expected text is plain string work.
VOCAB = ["a", "b", "c", "ab", "ba", "aab", "bab", "aaaa", "z", "é"]


def actor(vocab: list[str] = VOCAB) -> DetokenizerActor:
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="z"))
    tokenizer.decoder = decoders.Fuse()
    detok = object.__new__(DetokenizerActor)  # no process, no rings: only the text logic
    detok.backend, detok.streams = tokenizer, {}
    return detok


def run(
    detok: DetokenizerActor, stops: list[str], chunks: list[list[int]], finish: str | None, generated: tuple[int, ...] | list[int] = ()
) -> tuple[str, str | None, bool, str | int | None]:
    """Push `chunks` of token ids through `_apply`, the last with `finish`: the text, finish, abort flag and matched stop."""
    text, final, abort, matched = "", None, False, None
    for i, new in enumerate(chunks):
        announce = Announce(Detok(stops, True, 0), list(generated), 3, 0) if i == 0 else None
        item = TokenItem(1, finish if i == len(chunks) - 1 else None, new, announce=announce)
        if (delta := detok._apply(item)) is not None:
            text += delta.text
            final, abort, matched = delta.finish or final, abort or delta.abort, delta.matched_stop
    return text, final, abort, matched


def split(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, at = [], 0
    for size in sizes:
        if at < len(tokens):
            chunks.append(tokens[at : at + size])
            at += size
    return chunks + ([tokens[at:]] if at < len(tokens) else [])


TOKENS = st.lists(st.integers(0, len(VOCAB) - 2), min_size=1, max_size=16)  # no "é": kept for the unicode test
SIZES = st.lists(st.integers(1, 4), max_size=16)


@settings(max_examples=200, deadline=None)
@given(stops=STOPS, tokens=TOKENS, sizes=SIZES, finish=st.sampled_from(["length", "stop"]))
def test_detokenizer_text_through_stop_strings(stops: list[str], tokens: list[int], sizes: list[int], finish: str) -> None:
    shown = tokens[:-1] if finish == "stop" else tokens  # the stop token leaves no text
    full = "".join(VOCAB[t] for t in shown)
    cut = first_match(full, stops)
    chunks = split(tokens, sizes)
    text, final, abort, matched = run(actor(), stops, chunks, finish)
    assert text == (full if cut is None else full[:cut])
    assert final == ("stop" if cut is not None else finish)
    assert matched == (first_stop(full, stops)[1] if cut is not None else tokens[-1] if finish == "stop" else None)
    before_last = "".join(VOCAB[t] for chunk in chunks[:-1] for t in chunk)
    assert abort == (first_match(before_last, stops) is not None)  # ended here, not by the scheduler: it must let go


@settings(max_examples=200, deadline=None)
@given(stops=STOPS, tokens=TOKENS, sizes=SIZES, data=st.data())
def test_a_replay_continues_where_the_client_was(stops: list[str], tokens: list[int], sizes: list[int], data) -> None:
    k = data.draw(st.integers(0, len(tokens) - 1))
    seen, final, _, _ = run(actor(), stops, [[t] for t in tokens[:k]], None) if k else ("", None, False, None)
    if final is not None:  # ended before the replay point: nothing to replay
        return
    whole, whole_final, _, whole_matched = run(actor(), stops, [[t] for t in tokens], "length")
    rest, rest_final, _, rest_matched = run(actor(), stops, split(tokens[k:], sizes), "length", generated=tokens[:k])
    assert seen + rest == whole and rest_final == whole_final and rest_matched == whole_matched


def test_no_stop_strings_no_matcher() -> None:
    detok = actor()
    assert run(detok, [], [[0, 3], [7]], None) == ("aabaaaa", None, False, None)
    assert detok.streams[1].matcher is None and detok.streams[1].held == ""


def test_held_text_is_released_at_a_stop_token() -> None:
    """A stop string that starts like the output and never completes: held, then released at EOS."""
    a, b, z = VOCAB.index("a"), VOCAB.index("b"), VOCAB.index("z")
    assert run(actor(), ["abc"], [[a], [b], [z]], "stop") == ("ab", "stop", False, z)
    assert run(actor(), ["abc"], [[a], [b]], "length") == ("ab", "length", False, None)


def test_multibyte_text_across_tokens() -> None:
    e, a = VOCAB.index("é"), VOCAB.index("a")
    assert run(actor(), ["éaé"], [[a, e], [a], [e, a]], "length") == ("a", "stop", False, "éaé")


def elapsed(stops: list[str], chunks: list[list[int]]) -> float:
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        run(actor(), stops, chunks, "length")
        best = min(best, time.perf_counter() - began)
    return best


def test_long_near_miss_stop_strings_cost_about_what_one_short_one_does() -> None:
    """16 stop strings of 256 characters that every 'a' nearly completes, against a single 'z': before,
    every token tried each prefix length of each stop string (hundreds of times slower)."""
    chunks = [[VOCAB.index("aaaa")]] * 5000  # 20,000 characters, 4 a token
    near = ["a" * 255 + chr(ord("b") + i) for i in range(16)]
    one = elapsed(["z"], chunks)
    many = elapsed(near, chunks)
    assert many < 10 * one, f"{many * 1e3:.1f} ms with 16 near-miss stop strings against {one * 1e3:.1f} ms with one"


def test_smollm2_tokenizer(smollm2: Path) -> None:
    """The real tokenizer's incremental decoding, multi-byte characters included, cut by a stop string."""
    from runtime.models.source import load_tokenizer

    tokenizer = load_tokenizer(smollm2, required=True)
    sentence = "Le café naïve — 日本語のテキスト, then a stop here and more text after it."
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    full = tokenizer.decode(ids)
    detok = object.__new__(DetokenizerActor)
    detok.backend, detok.streams = tokenizer.backend_tokenizer, {}
    for stop in ("stop here", "のテ", "fé n", "nowhere"):
        expected = (full[: full.index(stop)], "stop") if stop in full else (full, "length")
        for sizes in ([1] * len(ids), [3] * len(ids)):
            text, final, _, matched = run(detok, [stop], split(ids, sizes), "length")
            assert (text, final) == expected and matched == (stop if final == "stop" else None), (stop, sizes)


@settings(max_examples=200, deadline=None)
@given(stops=STOPS, tokens=TOKENS, sizes=SIZES)
def test_a_stop_string_inside_a_step_of_several_tokens_keeps_what_one_at_a_time_would(
    stops: list[str], tokens: list[int], sizes: list[int]
) -> None:
    """A speculative step gives several tokens at once: a stop string among them ends the output, ids and
    completion count, at the token that completes it, as steps of one token each would."""

    def ids_and_count(chunks: list[list[int]]) -> tuple[list[int], int | None]:
        detok, ids, count = actor(), [], None
        for i, new in enumerate(chunks):
            announce = Announce(Detok(stops, True, 0), [], 3, 0) if i == 0 else None
            if (delta := detok._apply(TokenItem(1, "length" if i == len(chunks) - 1 else None, new, announce=announce))) is not None:
                ids += delta.token_ids
                count = (delta.usage or {}).get("completion_tokens", count)
        return ids, count

    assert ids_and_count(split(tokens, sizes)) == ids_and_count([[token] for token in tokens])
