"""Quality on real text with a real pair (``specprefill eval --real``): the target answering questions about
facts planted in the standard library's prose and about its code (``specprefill_lab.haystack``), through live
gateways, with each draft and at each keep rate.

Every draft is one ``specprefill serve`` process serving the pair's target on the in-process reference engine,
asked with the OpenAI SDK as a user would (``x-keep-rate`` per request, greedy, up to 64 tokens):

- ``target``: the target as its own draft (the paper's upper bound);
- ``self-K``: the target's first K layers with its final norm and head (``--draft-layers K``);
- the pair's smaller model (``0.5b`` for the Qwen2.5-Coder pair), whole and as its first K layers (``0.5b-K``);
- ``cross``: the project's small trained draft with another tokenizer, mapped (``--draft-tokenizer-mapping``;
  SmolLM2 only: it reads at most about 2,000 tokens);
- ``random``, ``head``, ``tail``: the same selection rule on baseline scores.

Each model draft may also score with an observation window (``NAME/wN``). The full prompt (``x-specprefill:
off``) is asked once per sample. Planner ``fresh``: every request gets a fresh selection at its keep rate (the
cost planner would send some prompts whole and measure nothing). Answers go to ``answers.jsonl`` as they come:
a run that stops resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import torch
from tqdm import tqdm
from transformers import AutoConfig

from common.models import compute_dtype, load_tokenizer
from gateway.planning.policy import Reason
from specprefill.real_models.catalog import RealPair
from specprefill.real_models.checkpoint import ensure_checkpoint
from specprefill_lab.haystack import (
    CODE_TASK,
    RULE_TASK,
    TASKS,
    HaystackSample,
    make_code_haystack,
    make_haystack,
)
from specprefill_lab.launch import launched_gateway

KEEP_RATES = (0.3, 0.1, 0.05)
LENGTHS = (2000, 8000, 16000)
SELF_LAYERS = (4, 8, 12)
CROSS_DRAFT = Path(__file__).resolve().parent / "data" / "retrieval-pair" / "draft-bpe"
MAX_TOKENS = 64  # the longest answer: 24 until 2026-12-07, which cut some wordy answers before their value


@dataclass(frozen=True)
class EvalPair:
    """A real pair's checkpoints as the eval runs them, and what its drafts are called."""

    pair: RealPair
    target: Path
    draft: Path | None  # the pair's smaller model (None: the target drafts for itself)

    @classmethod
    def made(cls, pair: RealPair) -> EvalPair:
        """The pair with its checkpoints made (on first use)."""
        draft = ensure_checkpoint(pair.draft) if pair.draft != pair.target else None
        return cls(pair, ensure_checkpoint(pair.target), draft)

    @property
    def draft_label(self) -> str:
        """The smaller model's name in the tables: its size (``0.5b``)."""
        return self.pair.draft.key.rsplit("-", 1)[-1]

    @property
    def default_variant(self) -> str:
        """The variant that `specprefill serve` runs for this pair by default."""
        pair = self.pair
        name = self.draft_label if self.draft is not None else "self"
        if pair.draft_layers:
            name += f"-{pair.draft_layers}"
        elif self.draft is None:
            name = "target"
        name += f"/w{pair.observation_window}" if pair.observation_window > 1 else ""
        return name + (f"/cap{pair.max_chunks}" if pair.max_chunks else "")

    @property
    def rule(self) -> str:
        """The system-prompt rule its target obeys with the whole prompt (``haystack.RULES``)."""
        return "french" if self.pair.key == "smollm2" else "json"

    @property
    def code(self) -> bool:
        """Whether its target is asked about code (a coder model)."""
        return self.pair.key != "smollm2"


def variants(
    pair: EvalPair, self_layers: Sequence[int] = SELF_LAYERS, draft_layers: Sequence[int] = (), windows=()
) -> dict[str, list[str]]:
    """Each draft as the gateway's flags; each model draft also with each observation window in ``windows``
    (``NAME/wN``: ``--observation-window N``)."""
    target = str(pair.target)
    out = {"target": ["--draft-model", target]}
    out |= {f"self-{k}": ["--draft-model", target, "--draft-layers", str(k)] for k in self_layers}
    if pair.draft is not None:
        label, draft = pair.draft_label, str(pair.draft)
        out[label] = ["--draft-model", draft]
        if pair.pair.draft_layers:  # the served default is always one of the rows
            draft_layers = sorted({*draft_layers, pair.pair.draft_layers})
        out |= {f"{label}-{k}": ["--draft-model", draft, "--draft-layers", str(k)] for k in draft_layers}
    if not pair.code:  # SmolLM2's: the cross-tokenizer draft reads about 2,000 of its tokens
        out["cross"] = ["--draft-model", str(CROSS_DRAFT)]
    out |= {
        f"{name}/w{n}": [*args, "--observation-window", str(n)] for name, args in list(out.items()) for n in windows
    }
    base, *rest = pair.default_variant.split("/")
    if rest and base in out:  # the served default's window and chunks are always one of the rows too
        flags = [*out[base]]
        if pair.pair.observation_window > 1:
            flags += ["--observation-window", str(pair.pair.observation_window)]
            out.setdefault(f"{base}/w{pair.pair.observation_window}", [*flags])
        if pair.pair.max_chunks:
            flags += ["--max-chunks", str(pair.pair.max_chunks)]
        out.setdefault(pair.default_variant, flags)
    out |= {kind: ["--draft-model", f"baseline:{kind}"] for kind in ("random", "head", "tail")}
    return out


def named_variants(specs: Sequence[str]) -> dict[str, list[str]]:
    """Drafts of one's own: each ``NAME=GATEWAY FLAGS`` (``0.5b/p8=--draft-model DIR --propagate-layer 8``) as the
    gateway flags its answers are asked with. Raises ``ValueError`` for one without a name or flags."""
    out = {}
    for spec in specs:
        name, _, flags = spec.partition("=")
        if not name.strip() or not flags.split():
            raise ValueError(f"{spec!r}: write NAME=GATEWAY FLAGS (e.g. 'mine=--draft-model DIR --look-ahead 16')")
        out[name.strip()] = flags.split()
    return out


@dataclass(frozen=True)
class Item:
    length: int  # the asked length (the chat's tokens, about)
    index: int  # the haystack's number at that length
    sample: HaystackSample


def items(pair: EvalPair, lengths, samples: int, rule_lengths: Sequence[int] = (), seed: int = 1234) -> list[Item]:
    """Every length's haystacks (each asked every task's question), its code haystacks where the pair is asked
    about code, and the rule's own haystacks at each of ``rule_lengths``."""
    tokenizer = load_tokenizer(pair.target)

    def count(messages: list[dict]) -> int:
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))

    out = []
    for length in lengths:
        rng = random.Random(seed + length)
        for index in range(samples):
            out += [Item(length, index, s) for s in make_haystack(length, rng, count)]
        if pair.code:
            rng = random.Random(seed + length + 2)
            out += [Item(length, index, make_code_haystack(length, rng, count)) for index in range(samples)]
    for length in rule_lengths:
        rng = random.Random(seed + length + 1)
        for index in range(samples):
            out += [Item(length, index, s) for s in make_haystack(length, rng, count, (RULE_TASK,), rule=pair.rule)]
    return out


Keep = float | str  # a fixed keep rate, or "auto@T": ``x-keep-rate: auto`` with the mass target T


def keep_label(keep: Keep) -> str:
    return keep if isinstance(keep, str) else f"{keep:g}"


def keep_order(keep: Keep) -> tuple[int, float]:
    """Fixed rates from the largest down, then the auto rule's targets from the largest down."""
    if isinstance(keep, str):
        return 1, -float(keep.partition("@")[2] or 0)
    return 0, -keep


def keep_request(keep: Keep) -> tuple[dict[str, str], dict | None]:
    """The headers and body extension that ask for ``keep``."""
    if isinstance(keep, str):
        return {"x-keep-rate": "auto"}, {"specprefill": {"auto_target": float(keep.partition("@")[2])}}
    return ({"x-specprefill": "off"} if keep == 1 else {"x-keep-rate": f"{keep:g}"}), None


def _key(length: int, index: int, task: str, variant: str, keep: Keep) -> str:
    return f"{length}/{index}/{task}/{variant}/{keep_label(keep)}"


FINAL = {Reason.PROMPT_TOO_LONG}  # bypasses a resume would meet again: the answer stands


def answered(paths: Iterable[Path]) -> list[dict]:
    """The answers these ``answers.jsonl`` files hold, as a resume would count them (where two files answered
    one question, the later file's answer)."""
    done: dict[str, dict] = {}
    for path in paths:
        done |= _done(path, redo_cut=False)
    return list(done.values())


def _done(path: Path, redo_cut: bool = True, dtype: str | None = None) -> dict[str, dict]:
    """The answers a resume keeps, by question; ``redo_cut``: without the answers it asks again (``cut_short``,
    those computed in ``dtype`` where given), which the tables still count as they stand until they are."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # a draft's answer from a prompt that went whole because its draft failed measured nothing: asked again; one
    # that went whole because the draft cannot read that many tokens would go whole again: kept
    rows = [r for r in rows if r["variant"] == "full" or r["status"] == "compressed" or r.get("reason") in FINAL]
    rows = [r for r in rows if not (redo_cut and cut_short(r, dtype=dtype))]
    return {_key(r["length"], r["index"], r["task"], r["variant"], r["keep"]): r for r in rows}


def cut_short(row: dict, max_tokens: int = MAX_TOKENS, dtype: str | None = None) -> bool:
    """Whether an answer is asked again: it was wrong where its answer ran into a lower limit of tokens than
    ``max_tokens`` (greedy: the longer answer begins with it, so a right one stays right and needs no asking),
    and, where ``dtype`` is given, it was computed in that dtype. Asked in another, the answer is not the cut
    one made longer: 10 of 19 bfloat16 answers asked again in float32 (2 AVX2 cores, 2026-12-07) parted from
    theirs before the old limit, and 4 of the 5 that came back right were among them, a second draw for the
    wrong answers only. Those stand as they are (a floor) until a run in their dtype asks them."""
    return (
        row.get("finish") == "length"
        and not row["correct"]
        and row.get("max_tokens", max_tokens) < max_tokens
        and (dtype is None or row.get("dtype") == dtype)
    )


def _ask(client: openai.OpenAI, model: str, item: Item, variant: str, keep: Keep) -> dict:
    headers, body = keep_request(keep)
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=item.sample.messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers=headers,
        extra_body=body,
    )
    choice = raw.parse().choices[0]
    text = choice.message.content or ""
    return {
        "length": item.length,
        "index": item.index,
        "task": item.sample.task,
        "variant": variant,
        "keep": keep,
        "tokens": int(raw.headers["x-specprefill-original-tokens"]),
        "kept": int(raw.headers["x-specprefill-kept-tokens"]),
        "status": raw.headers["x-specprefill-status"],
        "reason": raw.headers.get("x-specprefill-reason"),  # why it went whole, where it did
        "applied": float(raw.headers["x-specprefill-keep-rate"]),  # the rate applied (auto: the one chosen)
        "answer": text,
        "max_tokens": MAX_TOKENS,
        "finish": choice.finish_reason,  # "length": cut at max_tokens
        "expected": item.sample.answer,
        "correct": item.sample.correct(text),
        "obeys": item.sample.obeys(text),
        "depths": item.sample.depths,
    }


def save_items(everything: list[Item], path: Path) -> None:
    """The haystacks as asked: another machine (another Python, whose standard library is other prose) asks the
    same ones from this file."""
    with path.open("w") as sink:
        for i in everything:
            sink.write(json.dumps({"length": i.length, "index": i.index, **asdict(i.sample)}) + "\n")


def load_items(path: Path) -> list[Item]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            length, index = row.pop("length"), row.pop("index")
            out.append(Item(length, index, HaystackSample(**row)))
    return out


def draft_limit(args: list[str]) -> int | None:
    """The longest prompt a draft reads: its checkpoint's positions (the cross draft's 8,192 count its own
    tokenizer's tokens, 3.8-3.9 to each of SmolLM2's on this prose), or no limit."""
    folder = Path(args[args.index("--draft-model") + 1])
    config = folder / "config.json"
    if not config.is_file():
        return None
    positions = json.loads(config.read_text()).get("max_position_embeddings")
    return positions // 4 if positions and folder == CROSS_DRAFT else positions


@dataclass(frozen=True)
class Job:
    """One gateway's share: a draft's (or the full prompt's) answers at one length."""

    length: int
    name: str
    args: list[str]
    todo: list[tuple[Item, float]]


@dataclass(frozen=True)
class Counts:
    """How many haystacks each cell asks: ``samples``, and ``more`` for the full prompt and for the variant
    ``favoured`` at the keep rates ``favoured_keeps`` (the default draft's cells that the goal reads)."""

    samples: int
    more: int = 0
    favoured: str | None = None
    favoured_keeps: tuple[Keep, ...] = (0.3, 0.1)

    def wanted(self, variant: str, keep: Keep) -> int:
        if variant == "full" or (variant == self.favoured and keep in self.favoured_keeps):
            return max(self.samples, self.more)
        return self.samples

    @property
    def most(self) -> int:
        return max(self.samples, self.more)


def _jobs(everything: list[Item], drafts: dict[str, list[str]], keep_rates, done: dict, order, counts) -> list[Job]:
    jobs = []
    for length in order:
        mine = [i for i in everything if i.length == length]
        full = [
            (i, 1.0)
            for i in mine
            if i.index < counts.wanted("full", 1.0) and _key(length, i.index, i.sample.task, "full", 1.0) not in done
        ]
        if full:  # asked once per sample, whatever the draft (the gateway does not draft it)
            jobs.append(Job(length, "full", drafts.get("random", next(iter(drafts.values()))), full))
        for name, args in drafts.items():
            limit = draft_limit(args)
            if limit is not None and length > limit:
                print(f"real eval: {name} reads at most {limit} tokens; not asked at {length}")
                continue
            todo = [
                (i, keep)
                for i in mine
                for keep in keep_rates
                if i.index < counts.wanted(name, keep) and _key(length, i.index, i.sample.task, name, keep) not in done
            ]
            if todo:
                jobs.append(Job(length, name, args, todo))
    return jobs


def gateway_args(pair: EvalPair, device: str) -> list[str]:
    """Every draft's gateway: the pair's target, a fresh selection per request at its keep rate."""
    return [
        *("--target-model", str(pair.target), "--served-model-name", pair.pair.target.name),
        *("--planner", "fresh", "--min-prompt-tokens", "64", "--device", device, "--log-level", "warning"),
        *("--draft-timeout", "600"),  # accuracy, not speed: a draft slowed by a busy machine still answers
        "--no-calibrate",  # a fresh plan for every request prices nothing: no start-up probe of the target
    ]


def run_real_eval(
    pair: EvalPair,
    out: Path,
    *,
    lengths=LENGTHS,
    counts: Counts = Counts(30),
    keep_rates=KEEP_RATES,
    drafts: dict[str, list[str]],
    rule_lengths: Sequence[int] = (),
    haystacks: Path | None = None,
    device: str = "cpu",
    parallel: int = 1,
    tasks: Sequence[str] = (),
) -> list[dict]:
    """Every answer (resumed from ``out/answers.jsonl``), lengths in the order given, each length's drafts in the
    order ``drafts`` gives them, ``parallel`` gateways at a time. The haystacks are written to
    ``out/haystacks.jsonl``, or read from ``haystacks`` (another run's). ``tasks``: only these (default: all);
    the haystacks written are all of them, so that a later run asks the others of the same haystacks."""
    out.mkdir(parents=True, exist_ok=True)
    answers = out / "answers.jsonl"
    # what the gateways compute in (float32 on a CPU without fast bfloat16 kernels): kept with every answer
    config = AutoConfig.from_pretrained(pair.target)
    dtype = str(compute_dtype(config.dtype, torch.device(device))).removeprefix("torch.")
    done = _done(answers, dtype=dtype)
    everything = load_items(haystacks) if haystacks else items(pair, lengths, counts.most, rule_lengths)
    wanted = set(lengths) | set(rule_lengths)
    everything = [i for i in everything if i.length in wanted and i.index < counts.most]
    save_items(everything, out / "haystacks.jsonl")
    known = {*TASKS, CODE_TASK, RULE_TASK}
    if set(tasks) - known:
        raise ValueError(f"unknown task {sorted(set(tasks) - known)[0]!r}: tasks are {', '.join(sorted(known))}")
    if tasks:
        everything = [i for i in everything if i.sample.task in tasks]
    order = [n for n in dict.fromkeys([*lengths, *sorted(wanted)]) if any(i.length == n for i in everything)]
    common = gateway_args(pair, device)
    lock = threading.Lock()
    with answers.open("a") as sink:

        def answer(job: Job) -> None:
            with (
                launched_gateway([*common, *job.args]) as url,
                openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800) as client,
            ):
                for item, keep in tqdm(job.todo, desc=f"real eval: {job.length} tokens, {job.name}", unit="answer"):
                    row = _ask(client, pair.pair.target.name, item, job.name, keep)
                    row |= {"device": device, "dtype": dtype}
                    with lock:
                        done[_key(job.length, item.index, item.sample.task, job.name, keep)] = row
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()

        with ThreadPoolExecutor(parallel) as pool:
            jobs = _jobs(everything, drafts, keep_rates, done, order, counts)
            for future in [pool.submit(answer, job) for job in jobs]:
                future.result()
    return answered([answers])


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion."""
    if total == 0:
        return 0.0, 1.0
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar(lost: int, gained: int) -> float:
    """The exact two-sided McNemar p-value of paired answers: ``lost`` right on the whole prompt and wrong here,
    ``gained`` the reverse; under no difference each discordant pair goes either way with probability 1/2."""
    n = lost + gained
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(group: list[dict], full: dict[int, bool]) -> dict | None:
    """A cell's answers against the whole prompt's on the same haystacks (by index): how many of those pairs, the
    answers it lost and gained, and ``mcnemar``'s p (None without a pair: rows without an index)."""
    pairs = [(full[r["index"]], bool(r["correct"])) for r in group if r.get("index") in full]
    if not pairs:
        return None
    lost = sum(w and not c for w, c in pairs)
    gained = sum(c and not w for w, c in pairs)
    whole = sum(w for w, _ in pairs)
    return {
        "pairs": len(pairs),
        "lost": lost,
        "gained": gained,
        "paired_p": mcnemar(lost, gained),
        "of_whole_paired": (whole - lost + gained) / whole if whole else None,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """One cell per task, length, draft and keep rate (the full prompt as draft ``full``, keep 1): accuracy with
    its 95% interval, and for the rule task how often the answer obeyed it."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["task"], r["length"], r["variant"], r["keep"]), []).append(r)
    out = []
    for (task, length, variant, keep), group in sorted(
        cells.items(), key=lambda c: (c[0][0], c[0][1], keep_order(c[0][3]), c[0][2])
    ):
        right = sum(r["correct"] for r in group)
        low, high = wilson(right, len(group))
        cell = {
            "task": task,
            "length": length,
            "variant": variant,
            "keep": keep,
            "samples": len(group),
            "accuracy": right / len(group),
            "low": low,
            "high": high,
            "tokens": sum(r["tokens"] for r in group) / len(group),
            "kept": sum(r["kept"] for r in group) / len(group),
        }
        if isinstance(keep, str):  # the auto rule: the rates it applied, their mean and spread
            applied = [r.get("applied", r["kept"] / r["tokens"]) for r in group]
            mean = sum(applied) / len(applied)
            cell |= {"applied": mean, "applied_sd": math.sqrt(sum((a - mean) ** 2 for a in applied) / len(applied))}
        if task == RULE_TASK:
            cell["obeyed"] = sum(bool(r["obeys"]) for r in group) / len(group)
        out.append(cell)
    full = {(c["task"], c["length"]): c["accuracy"] for c in out if c["variant"] == "full"}
    whole: dict[tuple, dict[int, bool]] = {}
    for r in (r for key, group in cells.items() if key[2] == "full" for r in group if "index" in r):
        whole.setdefault((r["task"], r["length"]), {})[r["index"]] = bool(r["correct"])
    for c in out:
        base = full.get((c["task"], c["length"]))
        c["of_full"] = c["accuracy"] / base if base else None
        group = cells[c["task"], c["length"], c["variant"], c["keep"]]
        if c["variant"] != "full" and (pair := paired(group, whole.get((c["task"], c["length"]), {}))):
            # the share of the whole prompt's right answers on the same haystacks, where the answers pair up (a cell
            # asked on fewer haystacks than the whole prompt is not set against other haystacks' answers)
            c |= pair
            c["of_full"] = pair.pop("of_whole_paired")
    return out


def _console_cell(c: dict) -> str:
    """Accuracy, its interval, and against the whole prompt on the same haystacks (``-lost+gained p``)."""
    text = f"{c['accuracy']:>6.0%} [{c['low']:.0%}-{c['high']:.0%}]"
    if "lost" in c:
        text += f" -{c['lost']}+{c['gained']} p{c['paired_p']:.2f}"
    return text.rjust(30)


def format_summary(cells: list[dict]) -> Iterator[str]:
    for task in dict.fromkeys(c["task"] for c in cells):
        for length in sorted({c["length"] for c in cells if c["task"] == task}):
            mine = [c for c in cells if c["task"] == task and c["length"] == length]
            full = next((c for c in mine if c["variant"] == "full"), None)
            head = f"{task}, {length} tokens (about {mine[0]['tokens']:.0f}): "
            yield head + (
                f"full prompt {full['accuracy']:.0%} [{full['low']:.0%}, {full['high']:.0%}] of {full['samples']}"
                if full
                else "full prompt not asked"
            )
            keeps = sorted({c["keep"] for c in mine if c["variant"] != "full"}, key=keep_order)
            yield f"{'':>10} " + " ".join(f"{'keep ' + keep_label(k):>30}" for k in keeps)
            for variant in dict.fromkeys(c["variant"] for c in mine if c["variant"] != "full"):
                row = {c["keep"]: c for c in mine if c["variant"] == variant}
                yield f"{variant:>10} " + " ".join(_console_cell(row[k]) if k in row else " " * 30 for k in keeps)
            yield ""


TASK_ORDER = (*TASKS, CODE_TASK, RULE_TASK)


FRONTIER_TASKS = ("passkey", "fact", CODE_TASK)  # the goal's tasks: a passkey, a one-paragraph fact, a code lookup


def frontier(cells: list[dict], speeds: Iterable[tuple[str, str | Path]]) -> list[dict]:
    """One point per draft and keep rate: its accuracy as a share of the full prompt's on the goal's tasks (the
    mean over them, at each length the speed run measured) against its cold TTFT as a share of direct's (from
    ``speeds``: (draft, its ``specprefill bench`` folder or its ``bench.json`` as the docs keep it), a draft
    named again for another run, at other lengths)."""
    points = []
    for draft, where in speeds:
        path = Path(where)
        rows = json.loads((path if path.is_file() else path / "bench.json").read_text())["rows"]
        for row in rows:
            mine = [
                c
                for c in cells
                if c["variant"] == draft
                and c["keep"] == row["keep_rate"]
                and c["task"] in FRONTIER_TASKS
                and c["length"] == row["tokens"]
                and c["of_full"] is not None
            ]
            if not mine:
                continue
            points.append(
                {
                    "draft": draft,
                    "keep": row["keep_rate"],
                    "length": row["tokens"],
                    "ttft_of_direct": row["gateway_s"] / row["direct_s"],
                    "accuracy_of_full": sum(c["of_full"] for c in mine) / len(mine),
                    "tasks": sorted({c["task"] for c in mine}),
                }
            )
    return points


def plot_frontier(points: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for draft in dict.fromkeys(p["draft"] for p in points):
        mine = sorted((p for p in points if p["draft"] == draft), key=lambda p: (p["length"], p["keep"]))
        ax.plot([p["ttft_of_direct"] for p in mine], [p["accuracy_of_full"] for p in mine], "o", label=draft)
        # labels above and below in turn, left to right: neighbours do not overprint
        for i, p in enumerate(sorted(mine, key=lambda p: p["ttft_of_direct"])):
            ax.annotate(
                f"{p['keep']:g} @{p['length'] // 1000}k",
                (p["ttft_of_direct"], p["accuracy_of_full"]),
                fontsize=7,
                xytext=(3, 3 if i % 2 == 0 else -9),
                textcoords="offset points",
            )
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("cold TTFT through the gateway / direct (lower is faster)")
    tasks = [t for t in FRONTIER_TASKS if t in {c for p in points for c in p.get("tasks", FRONTIER_TASKS)}]
    ax.set_ylabel(f"accuracy / the full prompt's ({', '.join(tasks)})")
    ax.set_title(f"{model} on real text: each draft and keep rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _variant_order(variant: str) -> tuple[int, int, str]:
    """The target first, then the self-drafts, deepest first, then the smaller model whole and as its first
    layers, deepest first, then the cross draft and the baselines; each with an observation window
    (``DRAFT/wN``) after it."""
    draft = variant.split("/")[0]
    if draft.startswith("self-"):
        return 1, -int(draft.removeprefix("self-")), variant
    if draft[:1].isdigit():  # the smaller model: "0.5b", "0.5b-12"
        layers = draft.partition("-")[2]
        return 2, -int(layers) if layers else -1000, variant
    if draft in ("random", "head", "tail"):
        return 4, 0, variant
    return {"target": 0, "cross": 3}.get(draft, 3), 0, variant


def markdown_summary(cells: list[dict]) -> Iterator[str]:
    """The tables as the quality page shows them: one per task and length, a row per draft, accuracy with its 95%
    interval, against the whole prompt on the same haystacks (``−lost +gained (p …)``, ``paired``), and for the
    rule how often the answer obeyed it."""
    for task in [t for t in TASK_ORDER if any(c["task"] == t for c in cells)]:
        for length in sorted({c["length"] for c in cells if c["task"] == task}):
            mine = [c for c in cells if c["task"] == task and c["length"] == length]
            keeps = sorted({c["keep"] for c in mine if c["variant"] != "full"}, key=keep_order)
            full = next((c for c in mine if c["variant"] == "full"), None)

            def cell(c: dict) -> str:
                text = f"{c['accuracy']:.0%} [{c['low']:.0%}–{c['high']:.0%}]"
                if "lost" in c:  # against the whole prompt on the same haystacks
                    text += f"; −{c['lost']} +{c['gained']} (p {c['paired_p']:.2f})"
                text += f", rate {c['applied']:.2f} ± {c['applied_sd']:.2f}" if "applied" in c else ""
                return text + (f", obeyed {c['obeyed']:.0%}" if "obeyed" in c else "")

            yield (
                f"**{task}**, {length} tokens ({mine[0]['samples']} samples a cell; full prompt: "
                f"{cell(full) if full else 'not asked'})"
            )
            yield ""
            yield "| draft | " + " | ".join(f"keep {keep_label(k)}" for k in keeps) + " |"
            yield "| --- | " + " | ".join("---" for _ in keeps) + " |"
            for variant in sorted({c["variant"] for c in mine if c["variant"] != "full"}, key=_variant_order):
                row = {c["keep"]: c for c in mine if c["variant"] == variant}
                yield f"| {variant} | " + " | ".join(cell(row[k]) if k in row else "" for k in keeps) + " |"
            yield ""
