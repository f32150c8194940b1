"""Tasks over real text: facts planted at random depths in a haystack of the standard library's prose
(``specprefill.lab.prose``), asked at the end of a chat, answered by a real model.

One haystack carries every task's sentences, and each task asks its own question at its end (the questions
share the haystack as a prefix, as questions about one document do; the engine's and the draft's prefix
caches serve it once):
  passkey    a five-digit pass key, said twice in one short paragraph; "What is the pass key?"
  fact       one made-up fact in one paragraph (a person's home town); a question answerable from it alone
  two-fact   two sentences at least a quarter of the haystack apart (where a person works; where that place
             is); a question that needs both
  rule       the ``fact`` question under a system prompt with a rule that is easy to check (answer in French):
             whether the answer obeys it as well as whether it is right (a haystack of its own)

Names, places and keys are invented from syllables and digits, so a model can only answer by reading them. A
haystack is whole paragraphs drawn at random until the longest of its chats has about the asked number of
tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from specprefill.lab.prose import paragraphs

TASKS = ("passkey", "fact", "two-fact")
RULE_TASK = "rule"
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
RULE_SYSTEM = "You are a helpful assistant. Always answer in French."


def obeys_rule(answer: str) -> bool:
    """Whether an answer is in French, as far as its function words tell (the model at hand follows few other
    rules at all: capitals, a fixed opening or closing word were ignored even in short chats)."""
    return bool(FRENCH & set(answer.lower().replace(".", " ").replace(",", " ").split()))


@dataclass
class HaystackSample:
    task: str
    messages: list[dict]
    answer: str  # a right answer contains this, case aside
    depths: list[float] = field(default_factory=list)  # where each of its sentences sits, 0 (start) to 1 (end)

    def correct(self, answer: str) -> bool:
        return self.answer.lower() in answer.lower()

    def obeys(self, answer: str) -> bool | None:
        return obeys_rule(answer) if self.task == RULE_TASK else None


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
    tokens: int, rng: random.Random, count_tokens, tasks: tuple[str, ...] = TASKS
) -> list[HaystackSample]:
    """One haystack of about ``tokens`` tokens with every task's paragraphs planted at random depths, and one
    chat per task asking its question at the end. ``count_tokens(messages)`` counts a chat as the target's
    template renders it. The ``rule`` task adds its system prompt."""
    planted = {task: _planted(task, rng) for task in tasks}
    head = [{"role": "system", "content": RULE_SYSTEM}] if RULE_TASK in tasks else []
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
        HaystackSample(task, chat(body, question), answer, depths[task])
        for task, (_, question, answer) in planted.items()
    ]
