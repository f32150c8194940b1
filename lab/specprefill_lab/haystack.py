"""Tasks over real text: facts planted at random depths in a haystack of the standard library's prose
(``specprefill_lab.prose``), asked at the end of a chat, answered by a real model.

One haystack carries every task's sentences, and each task asks its own question at its end (the questions
share the haystack as a prefix, as questions about one document do; the engine's and the draft's prefix
caches serve it once):
  passkey    a five-digit pass key, said twice in one short paragraph; "What is the pass key?"
  fact       one made-up fact in one paragraph (a person's home town); a question answerable from it alone
  two-fact   two sentences at least a quarter of the haystack apart (where a person works; where that place
             is); a question that needs both
  rule       the ``fact`` question under a system prompt with a rule that is easy to check (``RULES``: in French,
             or as a JSON object):
             whether the answer obeys it as well as whether it is right (a haystack of its own)
  code       a haystack of the standard library's own functions and classes (``specprefill_lab.source_code``);
             one function's literal default is changed to an invented value, and the question asks for it
             (the model may know the real library by heart: only reading the haystack gives the changed value)

Names, places and keys are invented from syllables and digits, so a model can only answer by reading them. A
haystack is whole paragraphs drawn at random until the longest of its chats has about the asked number of
tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from specprefill_lab.prose import paragraphs
from specprefill_lab.source_code import Piece, pieces

TASKS = ("passkey", "fact", "two-fact")
RULE_TASK = "rule"
CODE_TASK = "code"
CODE_SKIP = ("encodings",)  # one codec module after another, each with the same two definitions
SYLLABLES = (
    "ba",
    "ka",
    "lo",
    "mi",
    "ru",
    "te",
    "vo",
    "zan",
    "dor",
    "qui",
    "sel",
    "tar",
    "wen",
    "fi",
    "gu",
    "ho",
    "ne",
    "pra",
    "sto",
    "vel",
    "yor",
    "kel",
    "mun",
    "ri",
    "tha",
    "bo",
    "dre",
    "lin",
)
FIRST_NAMES = (
    "Elena",
    "Marcus",
    "Priya",
    "Tomas",
    "Ingrid",
    "Kofi",
    "Yuki",
    "Rafael",
    "Amara",
    "Lukas",
    "Noor",
    "Mateo",
    "Saoirse",
    "Dmitri",
    "Leila",
    "Oskar",
    "Wen",
    "Hana",
    "Jonas",
    "Esme",
)
ORGANISATIONS = ("Institute", "Foundation", "Observatory", "Workshop", "Archive", "Conservatory", "Laboratory")
FRENCH = frozenset("le la les un une est et de du des il elle dans ville née né".split())
JSON_ANSWER = re.compile(r'\{\s*"answer"\s*:')


@dataclass(frozen=True, slots=True)
class Rule:
    """A system prompt's rule that is easy to check, and the check."""

    system: str
    obeyed: Callable[[str], bool]


RULES = {
    # whether an answer is in French, as far as its function words tell (SmolLM2-135M follows few other rules
    # at all: capitals, a fixed opening or closing word were ignored even in short chats)
    "french": Rule(
        "You are a helpful assistant. Always answer in French.",
        lambda answer: bool(FRENCH & set(answer.lower().replace(".", " ").replace(",", " ").split())),
    ),
    # an answer that opens a JSON object with its "answer" key (fenced or not; 16 tokens may cut it short).
    # Qwen2.5-Coder-1.5B obeyed it 10 of 10 times at 2,000 tokens and 6 of 6 at 8,000 with the whole prompt; in
    # French 1 of 10, capitals 5 of 10, an opening word 4 of 10 (the fact task's haystacks, greedy)
    "json": Rule(
        'You are a helpful assistant. Always answer with a JSON object of the form {"answer": "..."} and nothing else.',
        lambda answer: bool(JSON_ANSWER.search(answer)),
    ),
}
RULE_SYSTEM = RULES["french"].system


def obeys_rule(answer: str, rule: str = "french") -> bool:
    return RULES[rule].obeyed(answer)


@dataclass
class HaystackSample:
    task: str
    messages: list[dict]
    answer: str  # a right answer contains this, case aside
    depths: list[float] = field(default_factory=list)  # where each of its sentences sits, 0 (start) to 1 (end)
    rule: str = "french"  # the rule task's rule (RULES)

    def correct(self, answer: str) -> bool:
        return self.answer.lower() in answer.lower()

    def obeys(self, answer: str) -> bool | None:
        return obeys_rule(answer, self.rule) if self.task == RULE_TASK else None


def invented_word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def _planted(task: str, rng: random.Random) -> tuple[list[str], str, str]:
    """The paragraphs to plant, the question, and its answer."""
    person = f"{rng.choice(FIRST_NAMES)} {invented_word(rng)}"
    town = invented_word(rng)
    if task == "passkey":
        key = str(rng.randrange(10_000, 100_000))
        return [f"The pass key is {key}. Remember it. {key} is the pass key."], "What is the pass key?", key
    if task in ("fact", RULE_TASK):
        return (
            [f"Remember this: {person} was born in the town of {town}. {person} was born in {town}."],
            f"In which town was {person} born?",
            town,
        )
    organisation = f"{invented_word(rng, 2)} {rng.choice(ORGANISATIONS)}"
    return (
        [f"{person} works at the {organisation}.", f"The {organisation} is in the town of {town}."],
        f"In which town does {person} work?",
        town,
    )


def make_haystack(
    tokens: int, rng: random.Random, count_tokens, tasks: tuple[str, ...] = TASKS, rule: str = "french"
) -> list[HaystackSample]:
    """One haystack of about ``tokens`` tokens with every task's paragraphs planted at random depths, and one
    chat per task asking its question at the end. ``count_tokens(messages)`` counts a chat as the target's
    template renders it. The ``rule`` task adds its system prompt (``RULES[rule]``)."""
    planted = {task: _planted(task, rng) for task in tasks}
    head = [{"role": "system", "content": RULES[rule].system}] if RULE_TASK in tasks else []
    longest = max((q for _, q, _ in planted.values()), key=len)
    sentences = [s for paragraphs_, _, _ in planted.values() for s in paragraphs_]

    def chat(body: list[str], question: str) -> list[dict]:
        return [*head, {"role": "user", "content": "\n\n".join(body) + f"\n\n{question}"}]

    pool, chosen, average = paragraphs(), [], None
    while (have := count_tokens(chat(chosen + sentences, longest))) < tokens:
        average = average or max(1, have // max(1, len(chosen) + len(sentences)))
        chosen += [rng.choice(pool) for _ in range(max(1, (tokens - have) // average // 2))]
    while len(chosen) > 1 and count_tokens(chat(chosen[:-1] + sentences, longest)) >= tokens:
        chosen.pop()
    placed: list[tuple[float, str]] = []
    depths: dict[str, list[float]] = {}
    for task, (task_sentences, _, _) in planted.items():
        spots = sorted(rng.random() for _ in task_sentences)
        while len(spots) == 2 and spots[1] - spots[0] < 0.25:  # two-fact: a quarter of the haystack apart
            spots = sorted(rng.random() for _ in task_sentences)
        if len(spots) == 2 and rng.random() < 0.5:
            task_sentences = task_sentences[::-1]  # the place before the person, as often as after
        depths[task] = spots
        placed += zip(spots, task_sentences)
    body = list(chosen)
    for depth, sentence in sorted(placed, key=lambda pair: -pair[0]):  # the deepest first: indices stay valid
        body.insert(round(depth * len(chosen)), sentence)
    return [
        HaystackSample(task, chat(body, question), answer, depths[task], rule)
        for task, (_, question, answer) in planted.items()
    ]


def make_code_haystack(tokens: int, rng: random.Random, count_tokens) -> HaystackSample:
    """About ``tokens`` tokens of the standard library's functions and classes, each under a comment naming its
    file, one of them a function whose literal default for one parameter is changed to an invented value (a
    number for a number, a word for a string), planted at a random depth; the question asks for that default."""
    pool = [p for p in pieces() if not p.module.startswith(CODE_SKIP)]
    needle = rng.choice([p for p in pool if p.defaults])
    param, line, start, end = rng.choice(needle.defaults)
    lines = needle.source.splitlines()
    old = lines[line][start:end]
    if old[0] in "'\"":
        value = invented_word(rng).lower()
        literal = f"{old[0]}{value}{old[0]}"
    else:
        value = literal = str(rng.choice([v for v in range(100, 10_000) if str(v) != old]))
    lines[line] = lines[line][:start] + literal + lines[line][end:]
    planted = Piece(needle.module, needle.name, "\n".join(lines))
    others = [p for p in pool if p.name != needle.name]
    question = (
        f"What is the default value of the parameter `{param}` of the function `{needle.name}` in the code above? "
        "Answer with the value alone."
    )

    def chat(body: list[Piece]) -> list[dict]:
        code = "\n\n\n".join(f"# Lib/{p.module}\n{p.source}" for p in body)
        return [{"role": "user", "content": f"```python\n{code}\n```\n\n{question}"}]

    chosen: list[Piece] = []
    average = None
    while (have := count_tokens(chat([*chosen, planted]))) < tokens:
        average = average or max(1, have // (len(chosen) + 1))
        chosen += [rng.choice(others) for _ in range(max(1, (tokens - have) // average // 2))]
    while len(chosen) > 1 and count_tokens(chat([*chosen[:-1], planted])) >= tokens:
        chosen.pop()
    depth = rng.random()
    body = list(chosen)
    body.insert(round(depth * len(chosen)), planted)
    return HaystackSample(CODE_TASK, chat(body), value, [depth])
