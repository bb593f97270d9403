"""The built-in training corpus: English-like sentences generated from a fixed grammar.

It lets `harness train` run with no download and no data file. The text is a pure function of
`CORPUS_SEED` and `CORPUS_BYTES` through `SplitMix64`, so it is byte-identical on every machine
and Python version. It has structure a tiny byte-level GPT learns within a few hundred steps:
spelling of a small vocabulary, subject-verb agreement (singular nouns take "-s" verbs), and
sentence and paragraph punctuation.
"""

from __future__ import annotations

from functools import lru_cache

from harness.repro.splitmix import SplitMix64

CORPUS_SEED = 20240601
CORPUS_BYTES = 256 * 1024

_ADJECTIVES = ("small", "quick", "quiet", "old", "bright", "lazy", "brave", "green", "tired", "clever")
_NOUNS = ("fox", "dog", "cat", "bird", "farmer", "child", "river", "tree", "robot", "teacher")
_PLURALS = ("foxes", "dogs", "cats", "birds", "farmers", "children", "rivers", "trees", "robots", "teachers")
_TRANSITIVE = ("see", "follow", "help", "find", "watch", "carry", "call", "remember")
_INTRANSITIVE = ("sleep", "run", "sing", "wait", "rest", "dance", "laugh", "work")
_ADVERBS = ("slowly", "happily", "again", "at night", "all day", "near the house", "in the rain")
_PLACES = ("the field", "the old bridge", "the market", "the forest", "the school", "the hill")
_PREPOSITIONS = ("in", "near", "behind")
_SENTENCES_PER_PARAGRAPH = (3, 4, 5, 6)


def _noun_phrase(rng: SplitMix64) -> tuple[str, bool]:
    """A noun phrase and whether it is singular (the verb must agree)."""
    singular = rng.next_u64() % 2 == 0
    index = rng.next_u64() % len(_NOUNS)
    noun = _NOUNS[index] if singular else _PLURALS[index]
    determiner = rng.choice(("the", "a", "one", "that") if singular else ("the", "some", "two", "those"))
    if rng.next_u64() % 2 == 0:
        return f"{determiner} {rng.choice(_ADJECTIVES)} {noun}", singular
    return f"{determiner} {noun}", singular


def _verb(base: str, singular: bool) -> str:
    if not singular:
        return base
    if base.endswith("y"):
        return base[:-1] + "ies"
    return base + ("es" if base.endswith(("ch", "sh", "s", "x")) else "s")


def _sentence(rng: SplitMix64) -> str:
    subject, singular = _noun_phrase(rng)
    kind = rng.next_u64() % 3
    if kind == 0:
        obj, _ = _noun_phrase(rng)
        body = f"{subject} {_verb(rng.choice(_TRANSITIVE), singular)} {obj}"
    elif kind == 1:
        body = f"{subject} {_verb(rng.choice(_INTRANSITIVE), singular)} {rng.choice(_ADVERBS)}"
    else:
        place = f"{rng.choice(_PREPOSITIONS)} {rng.choice(_PLACES)}"
        body = f"{subject} {'is' if singular else 'are'} {place}"
    return body[0].upper() + body[1:] + "."


@lru_cache(maxsize=1)
def default_corpus() -> bytes:
    """`CORPUS_BYTES` bytes of ASCII text (cut at the byte limit), the same on every machine."""
    rng = SplitMix64(CORPUS_SEED)
    paragraphs: list[str] = []
    size = 0
    while size < CORPUS_BYTES:
        count = rng.choice(_SENTENCES_PER_PARAGRAPH)
        paragraph = " ".join(_sentence(rng) for _ in range(count)) + "\n"
        paragraphs.append(paragraph)
        size += len(paragraph)
    return "".join(paragraphs).encode("ascii")[:CORPUS_BYTES]
