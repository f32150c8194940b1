"""A RULER-style suite of synthetic long-context tasks (Hsieh et al., 2024), in one word-level vocabulary.

Every family hides what the question needs in a long stretch of filler sentences ("w17 w3 w250 ."), then asks
at the very end; the answer is a few words, checked exactly. The families differ in what the answer needs
from the context, which is what decides whether dropping most of it is safe:

- ``single``: one record ("the code for k12 v301 .") among distractor records; the answer is its value.
- ``multivalue``: every record holds a value of 2-3 words; the answer is the whole value.
- ``multiquery``: three keys asked at once; the answer goes key by key ("v1 k2 v2 k3 v3"), so three records
  spread over the context are all needed, and the prompt's last token points at the first only.
- ``variables``: variable tracking, multi-hop: chains "set k4 k9 ." ... "set k9 k30 ." ... "set k30 v7 ." in any
  order among other chains; asked for k4, the answer walks the chain ("k9 k30 v7"). The prompt's last token
  attends to the first hop; only the look-ahead finds the others.
- ``aggregation``: value words scattered through the filler sentences, one of them about twice as often as
  any other; the answer is the most common. Every mention counts a little, none decides.

A context is built so the answer follows from the prompt alone (``answer_from_prompt`` derives it from the
text, and the tests check that it matches); a seed reproduces every sample. ``TaskSample.qa`` may hold several
questions about one context: training asks them in a row, each answer followed by EOS; the eval asks the first.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from specprefill_lab import retrieval
from specprefill_lab.retrieval import N_FILLER, N_KEYS, N_VALUES

SUITE_VERSION = "v1"
SHIPPED_SUITE_PAIR = Path(__file__).parent / "data" / "suite-pair"
FAMILIES = ("single", "multivalue", "multiquery", "variables", "aggregation")
NEW_WORDS = ["codes", "answer", "set", "value", "of", "most", "common"]  # after the retrieval task's words


def vocabulary() -> list[str]:
    """The retrieval task's words with the same IDs (the suite pair starts from the retrieval pair), then the
    suite's own. Variables are key words ("set k4 k9 ."), so every family copies the same kinds of token."""
    return retrieval.vocabulary() + NEW_WORDS


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word, BOS first: answers are exact word matches."""
    return retrieval.make_tokenizer(vocabulary(), model_max_length=16384)


@dataclass(frozen=True, slots=True)
class TaskSample:
    family: str
    context: list[str]  # the words before the question
    qa: list[tuple[list[str], list[str]]]  # (question words, answer words), about this context

    @property
    def prompt(self) -> str:
        """The context and the first question: what the eval sends."""
        return " ".join(self.context + self.qa[0][0])

    @property
    def answer(self) -> str:
        return " ".join(self.qa[0][1])


def _filler(rng: random.Random) -> list[str]:
    return [f"w{rng.randrange(N_FILLER)}" for _ in range(rng.randint(4, 11))] + ["."]


def _scatter(rng: random.Random, n_words: int, statements: list[list[str]]) -> list[str]:
    """About ``n_words`` words of filler sentences with ``statements`` between them, in their order, at random
    sentence boundaries."""
    n_sentences = max(len(statements), n_words // 8)
    slots = sorted(rng.sample(range(n_sentences), len(statements)))
    words: list[str] = []
    pending = iter(zip(slots, statements))
    slot = next(pending, None)
    for sentence in range(n_sentences):
        while slot is not None and slot[0] == sentence:
            words += slot[1]
            slot = next(pending, None)
        words += _filler(rng)
    return words


def _records(rng: random.Random, n_words: int, n_records: int, value_words: int | tuple[int, int]):
    """Records "the code for K V... ." with distinct keys and distinct value words, scattered; (words, records)."""
    low, high = (value_words, value_words) if isinstance(value_words, int) else value_words
    keys = rng.sample(range(N_KEYS), n_records)
    values = iter(rng.sample(range(N_VALUES), n_records * high))
    records = [(f"k{k}", [f"v{next(values)}" for _ in range(rng.randint(low, high))]) for k in keys]
    return _scatter(rng, n_words, [["the", "code", "for", key, *value, "."] for key, value in records]), records


def _single(rng: random.Random, n_words: int, n_questions: int) -> TaskSample:
    words, records = _records(rng, n_words, min(N_VALUES, max(2, n_words // 40)), 1)
    asked = rng.sample(records, min(n_questions, len(records)))
    return TaskSample("single", words, [(["question", ":", "the", "code", "for", k], v) for k, v in asked])


def _multivalue(rng: random.Random, n_words: int, n_questions: int) -> TaskSample:
    words, records = _records(rng, n_words, min(N_VALUES // 3, max(2, n_words // 50)), (2, 3))
    asked = rng.sample(records, min(n_questions, len(records)))
    return TaskSample("multivalue", words, [(["question", ":", "the", "code", "for", k], v) for k, v in asked])


def _multiquery(rng: random.Random, n_words: int, n_questions: int, keys_asked: int = 3) -> TaskSample:
    words, records = _records(rng, n_words, min(N_VALUES, max(keys_asked + 1, n_words // 40)), 1)
    qa = []
    for _ in range(n_questions):
        asked = rng.sample(records, keys_asked)
        keys = [k for k, _ in asked]
        answer = [asked[0][1][0]] + [w for k, v in asked[1:] for w in (k, v[0])]
        qa.append((["question", ":", "the", "codes", "for", *keys, "answer", ":", keys[0]], answer))
    return TaskSample("multiquery", words, qa)


def _variables(rng: random.Random, n_words: int, n_questions: int, hops: int = 3) -> TaskSample:
    n_chains = max(2, n_words // 200)
    names = iter(rng.sample(range(N_KEYS), n_chains * hops))
    values = rng.sample(range(N_VALUES), n_chains)
    chains = [[f"k{next(names)}" for _ in range(hops)] + [f"v{values[c]}"] for c in range(n_chains)]
    statements = [["set", chain[i], chain[i + 1], "."] for chain in chains for i in range(hops)]
    rng.shuffle(statements)
    words = _scatter(rng, n_words, statements)
    asked = rng.sample(chains, min(n_questions, n_chains))
    return TaskSample(
        "variables", words, [(["question", ":", "the", "value", "of", chain[0]], chain[1:]) for chain in asked]
    )


def _aggregation(
    rng: random.Random, n_words: int, n_questions: int, candidates: int = 8, share: float = 0.22
) -> TaskSample:
    """~one mention per 3 sentences; the most common value takes ``share`` of them, the others split the rest
    as evenly as counts allow (so the winner leads by about 2x)."""
    n_sentences = max(candidates * 4, n_words // 8)
    mentions = max(candidates * 3, n_sentences // 3)
    pool = [f"v{v}" for v in rng.sample(range(N_VALUES), candidates)]
    top = max(round(mentions * share), math.ceil(mentions / candidates) + 2)
    rest = mentions - top
    counts = [top] + [rest // (candidates - 1) + (i < rest % (candidates - 1)) for i in range(candidates - 1)]
    bag = [word for word, count in zip(pool, counts) for _ in range(count)]
    rng.shuffle(bag)
    carriers = set(rng.sample(range(n_sentences), len(bag)))
    words: list[str] = []
    mentioned = iter(bag)
    for sentence in range(n_sentences):
        filler = _filler(rng)
        if sentence in carriers:
            filler.insert(rng.randrange(len(filler)), next(mentioned))
        words += filler
    return TaskSample("aggregation", words, [(["question", ":", "the", "most", "common", "value"], [pool[0]])])


GENERATORS: dict[str, Callable[[random.Random, int, int], TaskSample]] = {
    "single": _single,
    "multivalue": _multivalue,
    "multiquery": _multiquery,
    "variables": _variables,
    "aggregation": _aggregation,
}


def make_task(family: str, rng: random.Random, n_words: int, n_questions: int = 1) -> TaskSample:
    """A sample of ``family`` over about ``n_words`` words of context, with up to ``n_questions`` questions."""
    if family not in GENERATORS:
        raise ValueError(f"unknown task family {family!r}; choose from {', '.join(FAMILIES)}")
    return GENERATORS[family](rng, n_words, n_questions)


def samples(family: str, count: int, n_words: int, seed: int) -> list[TaskSample]:
    """The eval's samples of one family: the same for one seed, whatever else is asked for."""
    rng = random.Random(f"{seed}:{family}:{n_words}")
    return [make_task(family, rng, n_words) for _ in range(count)]


def answer_from_prompt(family: str, prompt: str) -> str:
    """The answer, worked out from the prompt's text alone (the generators' oracle, for the tests)."""
    words = prompt.split()
    question = len(words) - 1 - words[::-1].index("question")
    context, asked = words[:question], words[question:]
    if family in ("single", "multivalue", "multiquery"):
        values = {}
        for i in range(len(context) - 3):
            if context[i : i + 3] == ["the", "code", "for"]:
                end = context.index(".", i)
                values[context[i + 3]] = context[i + 4 : end]
        if family != "multiquery":
            return " ".join(values[asked[-1]])
        keys = asked[asked.index("for") + 1 : asked.index("answer")]
        return " ".join(values[keys[0]] + [w for k in keys[1:] for w in (k, *values[k])])
    if family == "variables":
        links = {context[i + 1]: context[i + 2] for i in range(len(context) - 2) if context[i] == "set"}
        chain, name = [], asked[-1]
        while name in links:
            name = links[name]
            chain.append(name)
        return " ".join(chain)
    if family == "aggregation":
        counts = Counter(w for w in context if w.startswith("v"))
        (top, n), (_, runner_up) = counts.most_common(2)
        assert n > runner_up, "the most common value is unique"
        return top
    raise ValueError(family)


def evidence_kept(family: str, prompt: str, kept: set[int]) -> bool:
    """Whether the words the answer is read from survive in ``kept`` (word indices into the prompt): the asked
    records' keys and values, every hop of the chain, or, for ``aggregation``, enough mentions that the most
    common value among those kept is still the answer. A measure of the selection alone, whatever the target
    can do with it."""
    words = prompt.split()
    question = len(words) - 1 - words[::-1].index("question")
    if family == "aggregation":
        counts = Counter(words[i] for i in kept if i < question and words[i].startswith("v"))
        ranked = counts.most_common(2)
        answer = answer_from_prompt(family, prompt)
        return bool(ranked) and ranked[0][0] == answer and (len(ranked) == 1 or ranked[0][1] > ranked[1][1])
    asked = words[question:]
    if family == "variables":
        statements = {words[i + 1]: i + 1 for i in range(question - 2) if words[i] == "set"}
        needed, name = [], asked[-1]
        while name in statements:  # each hop: the statement's two names
            needed += [statements[name], statements[name] + 1]
            name = words[statements[name] + 1]
        return all(i in kept for i in needed)
    keys = asked[asked.index("for") + 1 :]
    keys = keys[: keys.index("answer")] if "answer" in keys else keys
    needed = []
    for i in range(question - 3):
        if words[i : i + 3] == ["the", "code", "for"] and words[i + 3] in keys:
            needed += range(i + 3, words.index(".", i))
    return all(i in kept for i in needed)
