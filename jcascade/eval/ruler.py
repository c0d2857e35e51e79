"""RULER's synthetic long-context tasks (Hsieh et al. 2024; hsiehjackson/RULER, `scripts/data/synthetic/`),
generated offline at a context length counted in the model's tokens, and RULER's scoring.

Tasks (`TASKS`), as RULER's `synthetic.yaml` defines them:

- needle in a haystack: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery. Keys are
  "adjective-noun" words or UUIDs, values 7-digit numbers or UUIDs, in needle sentences "One of the special
  magic numbers for {key} is: {value}." hidden in a haystack of repeated noise sentences, of distractor
  needles, or of prose. RULER's prose is Paul Graham's essays, which it downloads; here it is the
  public-domain books jcascade ships (`texts.load_book`), so scores of the prose tasks (niah_single_2/3,
  niah_multikey_1, niah_multivalue, niah_multiquery) are not comparable with RULER's published ones.
- vt (variable tracking): a chain of 5 assignments "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE" hidden in
  noise; the answer is every variable that holds the value, after a one-shot example.
- cwe (common words extraction): a numbered list where 10 words appear 30 times and the others 3 times; the
  answer is the 10 common ones, after a one-shot example.
- fwe (frequent words extraction): random 6-letter "coded words" with Zipf frequencies (alpha 2); the answer
  is the three most frequent after the noise word "...".

RULER's two QA tasks are left out: their data (SQuAD, HotpotQA) comes only from a model hub.

A prompt is the tokenizer's chat template (when it has one) around the task text as the user message, then
RULER's answer prefix, which the model continues. Its length is sized by a bounded search over the haystack
units to the largest prompt with prompt tokens + the task's tokens to generate <= the context length; a
haystack that runs out first (the prose, cwe's word list) is refused with the numbers, not returned short.
The question, where RULER's templates place it, is the task text's last line, after the haystack and the
task's instruction ("What is the special magic number for ...", "Question: ..."): the question, the template's
closing and the answer prefix are what the query-agnostic protocol (`jcascade.eval.protocol`) keeps from the
compression; the tokens before it are the context.
Words come from the `wonderwords` package (as in RULER). Everything is deterministic given the seed: each
sample (task, length, index) seeds its own generator. Scoring (`string_match_all`): the fraction of the
expected strings found in the output, case-insensitively.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import itertools
import math
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jcascade.eval.checkpointing import complete, finished, prompts_sha256
from jcascade.eval.processes import built_once, gather_batches
from jcascade.eval.protocol import QUERY_AWARE, check, generate
from jcascade.eval.texts import distinct

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned in the "
    "provided text?"
)
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
    "assgined the value {query}, they are: "
)  # sic: RULER's spelling, kept so that prompts match
CWE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
ZETA_2 = math.pi**2 / 6  # sum of k^-2, fwe's Zipf normaliser for alpha = 2


@dataclasses.dataclass(frozen=True)
class Task:
    """One RULER task: its generator family and arguments, and how many tokens the answer may take."""

    family: str  # "niah", "vt", "cwe" or "fwe"
    tokens_to_generate: int
    haystack: str = "noise"  # niah: "noise" (repeated sentences), "needle" (distractor needles) or "prose"
    keys: str = "words"  # niah: "words" or "uuids"
    values: str = "numbers"  # niah: "numbers" or "uuids"
    num_keys: int = 1  # niah: needles with distinct keys
    num_values: int = 1  # niah: values per key
    num_queries: int = 1  # niah: keys asked for

    @property
    def needs_prose(self) -> bool:
        return self.haystack == "prose"


TASKS = {
    "niah_single_1": Task("niah", 128, haystack="noise"),
    "niah_single_2": Task("niah", 128, haystack="prose"),
    "niah_single_3": Task("niah", 128, haystack="prose", values="uuids"),
    "niah_multikey_1": Task("niah", 128, haystack="prose", num_keys=4),
    "niah_multikey_2": Task("niah", 128, haystack="needle"),
    "niah_multikey_3": Task("niah", 128, haystack="needle", keys="uuids", values="uuids"),
    "niah_multivalue": Task("niah", 128, haystack="prose", num_values=4),
    "niah_multiquery": Task("niah", 128, haystack="prose", num_keys=4, num_queries=4),
    "vt": Task("vt", 30),
    "cwe": Task("cwe", 120),
    "fwe": Task("fwe", 50),
}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt of a task. text: the user message (the task text, before any chat template); prompt: the
    token ids the model reads (chat template and answer prefix included), int32 [n]; answers: the strings
    the output should contain; needles: (sentence, character offset in `text`) of each hidden needle or
    chain line the answers come from; question_start: the index in `prompt` of the question's first token
    (the token that holds the question's first character, even if it starts before it): prompt[:question_start]
    is the context, prompt[question_start:] the question, template closing and answer prefix."""

    task: str
    context_length: int
    index: int
    text: str
    answer_prefix: str
    prompt: np.ndarray
    answers: tuple[str, ...]
    needles: tuple[tuple[str, int], ...]
    question_start: int


def words(kind: str) -> list[str]:
    """A `wonderwords` word list ("noun", "adjective" or "verb"), read from the installed package's data."""
    text = importlib.resources.files("wonderwords.assets").joinpath(f"{kind}list.txt").read_text(encoding="utf-8")
    return [w.strip() for w in text.splitlines() if w.strip()]


def sentences(prose: str) -> list[str]:
    """Prose split into sentences (at ., ! or ? followed by white space), white space collapsed."""
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(prose.split())) if s]


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's score of one output: the fraction of `answers` (a sequence of strings) found in it,
    case-insensitively, in [0, 1]."""
    if not isinstance(output, str):
        raise TypeError(f"output must be the generated text (a str), got {type(output).__name__}")
    if isinstance(answers, str | bytes) or not isinstance(answers, Sequence):
        raise TypeError(
            f"answers must be a sequence of expected strings (e.g. [{answers!r:.40}]), got {type(answers).__name__}"
        )
    if not answers:
        raise ValueError("answers must name at least one expected string")
    if not all(isinstance(a, str) for a in answers):
        raise TypeError(f"answers must be strings, got {[type(a).__name__ for a in answers]}")
    found = output.strip().lower()
    return sum(a.lower() in found for a in answers) / len(answers)


# ---- generators: each builds (text, answer prefix, answers, needles) from a unit count and a generator --------


def _value(kind: str, rng: np.random.Generator, adjectives: list[str], nouns: list[str]) -> str:
    if kind == "numbers":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    if kind == "uuids":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    return f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"


def _with_needles(units: list[str], needles: list[str], at: list[int], sep: str) -> tuple[str, list[tuple[str, int]]]:
    """`units` joined by `sep` with needles[i] inserted before unit at[i] (sorted); returns the text and each
    needle with its character offset."""
    parts, placed, offset, k = [], [], 0, 0
    order = np.argsort(at, kind="stable")
    for i in range(len(units) + 1):
        while k < len(order) and at[order[k]] == i:
            placed.append((needles[order[k]], offset))
            parts.append(needles[order[k]])
            offset += len(needles[order[k]]) + len(sep)
            k += 1
        if i < len(units):
            parts.append(units[i])
            offset += len(units[i]) + len(sep)
    return sep.join(parts), placed


def _niah(task: Task, units: int, rng: np.random.Generator, lists: dict, prose: list[str] | None, context_length: int):
    keys_kind = task.keys
    values_kind = task.values
    num_keys = max(task.num_keys, task.num_queries)
    keys = [_value(keys_kind, rng, lists["adjective"], lists["noun"]) for _ in range(num_keys)]
    values = [
        [_value(values_kind, rng, lists["adjective"], lists["noun"]) for _ in range(task.num_values)] for _ in keys
    ]
    needles = [NEEDLE.format(kind=values_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    if task.haystack == "prose":
        haystack, sep = prose[:units], " "
    elif task.haystack == "needle":
        haystack = [
            NEEDLE.format(
                kind=values_kind,
                key=_value(keys_kind, rng, lists["adjective"], lists["noun"]),
                value=_value(values_kind, rng, lists["adjective"], lists["noun"]),
            )
            for _ in range(units)
        ]
        sep = "\n"
    else:
        haystack, sep = [NOISE] * units, "\n"
    at = sorted(rng.choice(len(haystack) + 1, size=len(needles), replace=len(haystack) + 1 < len(needles)).tolist())
    context, placed = _with_needles(haystack, needles, at, sep)
    asked = sorted(rng.choice(num_keys, size=task.num_queries, replace=False).tolist())
    query = keys[asked[0]] if len(asked) == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    template, prefix, kind = NIAH, NIAH_PREFIX, values_kind
    if task.num_queries * task.num_values == 1:  # RULER asks for one value in the singular
        template, prefix = (
            t.replace("Some", "A").replace("are all", "is").replace("are", "is") for t in (NIAH, NIAH_PREFIX)
        )
        kind = values_kind[:-1]
    head = template.format(kind=kind, context="", query=query).split("\n")[0] + "\n"
    text = template.format(kind=kind, context=context, query=query)
    answers = tuple(v for i in asked for v in values[i])
    return text, prefix.format(kind=kind, query=query), answers, tuple((s, o + len(head)) for s, o in placed)


def _chain_names(count: int, length: int, rng: np.random.Generator) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(list(string.ascii_uppercase), length))
        if name not in names:
            names.append(name)
    return names


def _vt_instance(units: int, rng: np.random.Generator, name_length: int):
    names = _chain_names(5, name_length, rng)
    value = str(int(rng.integers(10_000, 100_000)))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(4)]
    at = sorted(rng.choice(units + 1, size=len(chain), replace=True).tolist())
    context, placed = _with_needles([NOISE] * units, chain, at, "\n")
    return context, placed, value, tuple(names)


def _vt(task: Task, units: int, rng: np.random.Generator, lists: dict, prose, context_length: int):
    example_context, _, example_value, example_names = _vt_instance(8, rng, 3)
    example = (
        VT.format(context=example_context, query=example_value)
        + VT_PREFIX.format(count=5, query=example_value)
        + " ".join(example_names)
    )
    context, placed, value, names = _vt_instance(units, rng, 5)
    head = example + "\n\n" + VT.format(context="", query=value).split("\n\n")[0] + "\n\n"
    text = example + "\n\n" + VT.format(context=context, query=value)
    return text, VT_PREFIX.format(count=5, query=value), names, tuple((s, o + len(head)) for s, o in placed)


def _cwe_list(units: int, rng: np.random.Generator, vocabulary: list[str], common: int, rare: int):
    # The first `units` words of one permutation: a list of more units holds the words of a shorter one, so the
    # prompt's tokens grow with its units and the search finds the largest prompt that fits.
    chosen = [vocabulary[i] for i in rng.permutation(len(vocabulary))[:units]]
    items = chosen[:10] * common + chosen[10:] * rare
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), tuple(chosen[:10])


def _cwe(task: Task, units: int, rng: np.random.Generator, lists: dict, prose, context_length: int):
    vocabulary = lists["cwe"]
    short = context_length < 4096  # RULER's smaller lists below 4K tokens
    example_context, example_answers = _cwe_list(20 if short else 40, rng, vocabulary, *((3, 1) if short else (10, 3)))
    example = (
        CWE.format(context=example_context)
        + CWE_PREFIX
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_answers))
    )
    context, answers = _cwe_list(max(units, 11), rng, vocabulary, *((6, 1) if short else (30, 3)))
    return example + "\n" + CWE.format(context=context), CWE_PREFIX, answers, ()


def _fwe(task: Task, units: int, rng: np.random.Generator, lists: dict, prose, context_length: int):
    vocabulary = sorted({"".join(rng.choice(list(string.ascii_lowercase), 6)) for _ in range(context_length // 50)})
    rng.shuffle(vocabulary)
    vocabulary = ["..."] + vocabulary[1:]
    counts = [int(units * k**-2.0 / ZETA_2) for k in range(1, len(vocabulary) + 1)] + [0]
    coded = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
    rng.shuffle(coded)
    # the answers: the three words after the noise word, if each is more frequent than every other word
    answers = tuple(vocabulary[1:4]) if len(vocabulary) >= 4 and counts[3] > counts[4] else ()
    return FWE.format(context=" ".join(coded)), FWE_PREFIX, answers, ()


_GENERATORS: dict[str, Callable] = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}


# ---- prompts ---------------------------------------------------------------------------------------------


class Generator:
    """Builds RULER samples in the tokens of `tokenizer` (a Hugging Face tokenizer). prose: the text of the
    prose haystack (e.g. `texts.load_book("paradise_lost")`), needed by the tasks whose `needs_prose`."""

    def __init__(self, tokenizer, prose: str | None = None):
        if prose is not None and not isinstance(prose, str):
            raise TypeError(f"prose must be text (a str; decode bytes first) or None, got {type(prose).__name__}")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "tokenizer: RULER's prompts find where their question starts from the tokenizer's "
                "character offsets, which only a fast (Rust-backed) Hugging Face tokenizer gives"
            )
        self.tokenizer = tokenizer
        nouns, adjectives = words("noun"), words("adjective")
        self.lists = {
            "noun": nouns,
            "adjective": adjectives,
            "cwe": sorted(set(nouns) | set(adjectives) | set(words("verb"))),
        }
        self.prose = sentences(prose) if prose is not None else None
        if self.prose == []:
            raise ValueError("prose: the prose haystack holds no text (an empty book?)")
        self._last_units: dict[tuple[str, int], int] = {}  # (task, context length): the last sample's units

    def _prompt(self, text: str, prefix: str) -> tuple[np.ndarray, int]:
        """The prompt's token ids int32 [n] and the index of its question's first token: the first token whose
        characters end after the start of the question (the text's last line) in the templated prompt."""
        tok = self.tokenizer
        chat = bool(getattr(tok, "chat_template", None))
        head = (
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            if chat
            else text
        )
        at = head.rindex(text[text.rindex("\n") + 1 :])  # the question, at the end of the user message
        encoded = tok(head + prefix, add_special_tokens=not chat, return_offsets_mapping=True)
        start = next(i for i, (_, end) in enumerate(encoded["offset_mapping"]) if end > at)
        return np.asarray(encoded["input_ids"], np.int32), start

    def build(self, task: str, context_length: int, index: int, seed: int, units: int) -> Sample:
        """Sample `index` of `task` at `context_length` with `units` haystack units, whether or not it fits (the
        draws depend on the seed, length, index and task alone, the same for every unit count)."""
        spec = TASKS[task]
        rng = np.random.default_rng([seed, context_length, index, list(TASKS).index(task)])
        text, prefix, answers, needles = _GENERATORS[spec.family](
            spec, units, rng, self.lists, self.prose, context_length
        )
        ids, question_start = self._prompt(text, prefix)
        return Sample(task, context_length, index, text, prefix, ids, answers, needles, question_start)

    def sample(self, task: str, context_length: int, index: int, seed: int = 0) -> Sample:
        """Sample `index` of `task` at `context_length` tokens (prompt + the task's tokens to generate): the
        prompt with the most haystack units that fits. Raises ValueError, with the numbers, when the context
        cannot hold the smallest prompt, when the prose (or cwe's word list) runs out with room for more in the
        context (the prompt would be shorter than asked), or when the prompt holds too few words to define the
        answers (fwe at a few hundred tokens)."""
        if task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
        if isinstance(context_length, bool) or not isinstance(context_length, (int, np.integer)) or context_length < 1:
            raise ValueError(f"context_length must be an int >= 1, got {context_length!r}")
        spec = TASKS[task]
        if spec.needs_prose and self.prose is None:
            raise ValueError(f"task {task!r} hides its needles in prose: give the Generator a prose text")
        budget = context_length - spec.tokens_to_generate
        build = functools.partial(self.build, task, context_length, index, seed)
        best = build(1)
        if len(best.prompt) > budget:
            raise ValueError(
                f"context_length={context_length} is too short for {task}: its smallest prompt takes "
                f"{len(best.prompt)} tokens + {spec.tokens_to_generate} to generate"
            )
        # The units that exist: the prose's sentences, cwe's words; else as many as `budget` tokens can hold: each
        # unit adds a token (a sentence, a line; fwe's a coded word every ZETA_2 = 1.64 units), so a prompt of
        # more would not fit, and no text built here is longer.
        haystack = (
            "sentences of the prose" if spec.needs_prose else "words of cwe's list" if spec.family == "cwe" else ""
        )
        most = len(self.prose) if spec.needs_prose else len(self.lists["cwe"]) if haystack else 2 * budget + 2
        # The largest unit count whose prompt fits (prompt tokens grow with units, so it is one count, whatever
        # the search's path): `low` units fit, `high` do not (None: not found yet). The first guess is the last
        # sample's count at this task and length (samples of one task differ by a few units), the next ones
        # interpolate the tokens per unit seen so far, so a few tokenizations find it. Where the tokens seen do
        # not grow with the units (cwe below 11 words), and after 8 guesses, it doubles (or bisects), so it ends
        # within 9 + 2 log2(most) tokenizations.
        tokens, low, high = {1: len(best.prompt)}, 1, None
        for step in itertools.count():
            if high is not None and high - low <= 1:
                break
            if low == most:
                self._check_filled(task, context_length, haystack, most, tokens)
                break
            other = high if high is not None else min(tokens)
            per_unit = (tokens[other] - tokens[low]) / (other - low) if other != low else tokens[low]
            if step == 0 and (task, context_length) in self._last_units:
                guess = self._last_units[task, context_length]
            elif step < 8 and per_unit > 0:
                guess = low + int((budget - tokens[low]) / per_unit)
            else:
                guess = 2 * low if high is None else (low + high) // 2
            units = min(max(guess, low + 1), most) if high is None else min(max(guess, low + 1), high - 1)
            candidate = build(units)
            tokens[units] = len(candidate.prompt)
            if tokens[units] <= budget:
                low, best = units, candidate
            else:
                high = units
        self._last_units[task, context_length] = low
        if not best.answers:
            raise ValueError(
                f"context_length={context_length} is too short for {task}: its largest prompt "
                f"({len(best.prompt)} tokens) holds too few words to define the answers (fwe: three "
                "coded words each more frequent than every other); use a longer context"
            )
        return best

    @staticmethod
    def _check_filled(task: str, context_length: int, haystack: str, most: int, tokens: dict[int, int]) -> None:
        """Raises ValueError when all `most` units fit (tokens: prompt tokens by unit count) with room for about
        one more: the haystack ran out before the context was filled, or (no `haystack`) the prompt does not
        grow with its units as the search assumes."""
        spec = TASKS[task]
        budget, filled = context_length - spec.tokens_to_generate, tokens[most]
        per_unit = (filled - tokens[1]) / (most - 1) if most > 1 else 0
        if not haystack:
            raise ValueError(
                f"{task} at context_length={context_length}: the search for the prompt's size cannot "
                f"converge: {most} units make a prompt of {filled} tokens (1 unit: {tokens[1]}), still "
                f"under the {budget} it may take; the tokenizer folds the units' text"
            )
        if budget - filled >= per_unit:
            raise ValueError(
                f"{task} at context_length={context_length}: all {most} {haystack} make a prompt of "
                f"{filled} tokens + {spec.tokens_to_generate} to generate, short of the "
                f"{context_length} asked; use shorter contexts"
                + (" or a longer prose text (--book)" if spec.needs_prose else "")
            )


# ---- evaluation: every policy at one budget ------------------------------------------------------------------

POLICIES = (
    "full",
    "sink",
    "cascade",
    "h2o",
    "snapkv",
    "pyramidkv",
    "tova",
    "knorm",
    "adakv",
    "expectedattention",
    "kvzip",
    "kvzip-head",
)  # the names `policies_at` knows
DEFAULT_POLICIES = POLICIES[:6]  # the command's default grid


def _names(text: str, known, what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in known]
    if unknown or not names:
        raise ValueError(f"{what} must be comma-separated names among {', '.join(known)}, got {text!r}")
    return distinct(what, names)


def task_list(text: str) -> list[str]:
    """ "niah_single_1,vt" -> the task names; "all" -> every task. Raises ValueError naming the known ones, or
    a task given twice (n counts each task's prompts once)."""
    return list(TASKS) if text.strip() == "all" else _names(text, TASKS, "tasks")


def policy_list(text: str) -> list:
    """The command's --policy: "full,cascade" -> the policy names of `policies_at` (scaled at each budget and
    length by `policy_grid`), each once; a spec with fields, "NAME:FIELD=VALUE,..." -> [that policy]
    (`jcascade.policies.parse_policy`), used as given."""
    from jcascade.policies import parse_policy

    if ":" in text:
        return [parse_policy(text)]
    try:
        return _names(text, POLICIES, "policies")
    except ValueError as e:
        raise ValueError(f"{e}, or a spec NAME:FIELD=VALUE,...") from None


def policy_grid(
    policies: Sequence, budgets: Sequence[float], tokenizer=None, kv_dtypes: Sequence[str] = ("model",)
) -> Callable[[int], dict[str, object]]:
    """A sweep's policies as a function of the context length (`sweep`'s `policies`), in the order given: each
    name of `POLICIES` at every budget and KV storage format (`policies_at`: scaled with the budget and the
    length), each policy object as it is at every length (labelled by `Policy.label`, as `report.labelled`).
    Raises ValueError for a name, budget or format given twice, or two policies of one label."""
    from jcascade.eval.report import labelled

    distinct("policies", [p for p in policies if isinstance(p, str)])
    distinct("budgets", budgets)
    distinct("kv_dtypes", kv_dtypes)
    given = list(labelled([p for p in policies if not isinstance(p, str)]).items())

    def at(context_length: int) -> dict[str, object]:
        fixed, grid = iter(given), {}
        for entry in policies:
            mine = (
                dict([next(fixed)])
                if not isinstance(entry, str)
                else {
                    k: v
                    for b in budgets
                    for d in kv_dtypes
                    for k, v in policies_at([entry], b, context_length, tokenizer, d).items()
                }
            )
            if set(mine) & set(grid):
                raise ValueError(
                    f"policies: two policies are labelled {sorted(set(mine) & set(grid))[0]!r}; "
                    "each label names one policy"
                )
            grid |= mine
        return grid

    return at


def kv_dtype_list(text: str) -> list[str]:
    """ "model,int8" -> KV storage formats (`jcascade.pallas_kernels.storage.KV_DTYPES`), each once."""
    from jcascade.pallas_kernels.storage import KV_DTYPES

    return _names(text, KV_DTYPES, "kv_dtypes")


def budget_list(text: str) -> list[float]:
    """ "0.25,0.5" or "2048,4096" -> budgets (fractions of the context, or token counts), each once."""
    try:
        budgets = [float(b) for b in text.split(",")]
    except ValueError:
        budgets = []
    if not budgets or any(not b > 0 or (b >= 1 and b != int(b)) for b in budgets):
        raise ValueError(f"budgets must be comma-separated fractions in (0, 1) or token counts, got {text!r}")
    return distinct("budgets", budgets)


def budget_slots(budget: float, context_length: int) -> int:
    """The KV slots a budget keeps at `context_length`: a fraction of the context when 0 < budget < 1, else a
    number of tokens. Sinks, windows and observation windows all count against it."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"budget must be a fraction in (0, 1) or a token count >= 1, got {budget!r}")
    slots = int(budget * context_length) if budget < 1 else int(budget)
    if slots < 128:
        raise ValueError(f"budget {budget} keeps {slots} slots at {context_length} tokens: at least 128 are needed")
    return slots


def policies_at(
    names: Sequence[str], budget: float, context_length: int, tokenizer=None, kv_dtype: str = "model"
) -> dict[str, object]:
    """{label: policy} for each policy name (`POLICIES`) keeping `budget_slots(budget, context_length)` KV slots
    per KV head, stored as `kv_dtype` (the policies' field; labels name a format other than "model"): Sink 64 sinks +
    the rest as window; Cascade 64 sinks + 4 cascades; H2O half heavy, half recent; TOVA all of them; SnapKV, PyramidKV,
    KNorm, ExpectedAttention and KVzip their budget (SnapKV's window 32, PyramidKV's 8; KVzip's reconstruction prompts
    in `tokenizer`'s tokens, which it needs; `kvzip` ranks every layer and KV head's tokens together, as the paper and
    kvpress do, `kvzip-head` keeps the budget in each KV head); AdaKV SnapKV's budget on average over a layer's heads.
    Streaming policies prefill in chunks of half their slots (at most 2048); labels name the budget
    ("Cascade 25%", "Cascade 12.5%", "Cascade 2048"), so distinct budgets label apart. Each name once."""
    import jcascade as jc
    from jcascade.eval.report import with_format

    if {"kvzip", "kvzip-head"} & set(names) and tokenizer is None:
        raise ValueError("policies_at: kvzip needs the tokenizer (its reconstruction prompts are token ids)")

    slots = budget_slots(budget, context_length)
    tag = f"{budget * 100:g}%" if budget < 1 else str(int(budget))
    stride, kw = min(2048, slots // 2), {"kv_dtype": kv_dtype}
    make = {
        "full": lambda: jc.Full(stride=2048, **kw),
        "sink": lambda: jc.Sink(window=slots - 64, sinks=64, stride=stride, **kw),
        "cascade": lambda: jc.Cascade(cache_size=(slots - 64) // 4 * 4, sinks=64, num_cascades=4, stride=stride, **kw),
        "h2o": lambda: jc.H2O(heavy=slots // 2, recent=slots - slots // 2, stride=stride, **kw),
        "snapkv": lambda: jc.SnapKV(budget=slots, stride=2048, **kw),
        "pyramidkv": lambda: jc.PyramidKV(budget=slots, stride=2048, **kw),
        "tova": lambda: jc.TOVA(cache_size=slots, stride=stride, **kw),
        "knorm": lambda: jc.KNorm(budget=slots, stride=2048, **kw),
        "adakv": lambda: jc.AdaKV(jc.SnapKV(budget=slots, stride=2048, **kw)),
        "expectedattention": lambda: jc.ExpectedAttention(budget=slots, stride=2048, **kw),
        "kvzip": lambda: jc.KVzip.for_tokenizer(tokenizer, slots, allocation="global", stride=2048, **kw),
        "kvzip-head": lambda: jc.KVzip.for_tokenizer(tokenizer, slots, allocation="head", stride=2048, **kw),
    }
    if any(n not in make for n in names):
        raise ValueError(f"policies must be among {list(make)}, got {list(names)}")
    distinct("policies", names)
    policies = {n: make[n]() for n in names}
    return {with_format("Full" if n == "full" else f"{p.label.split()[0]} {tag}", p): p for n, p in policies.items()}


def plan(
    generator: Generator, tasks: Sequence[str], context_lengths: Sequence[int], samples: int, seed: int = 0, model=None
) -> dict[int, list[Sample]]:
    """{context_length: the `samples` samples of every task, task-major} of a sweep, all built, and so checked
    (`Generator.sample` raises for a prompt that cannot fill its context), before any model time is spent.
    Tasks and lengths are each given once (`texts.distinct`: n counts each unit once). Where `model` splits over
    processes (`processes.splits`), each process builds a share of a length's samples and they are exchanged."""
    from jcascade.eval.passkey import check_context_lengths

    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty list of {list(TASKS)}, got {list(tasks)}")
    tasks = distinct("tasks", tasks)
    build = lambda unit: generator.sample(*unit, seed)
    return {
        n: built_once(build, [(task, n, i) for task in tasks for i in range(samples)], model)
        for n in check_context_lengths(context_lengths)
    }


@dataclasses.dataclass(frozen=True)
class RulerResult:
    policy: str  # label of the policy
    task: str
    context_length: int
    index: int
    prompt_tokens: int
    output: str
    score: float  # string_match_all(output, answers)


def sweep(
    model,
    tokenizer,
    policies: Mapping[str, object] | Callable[[int], Mapping[str, object]],
    context_lengths: Sequence[int],
    *,
    tasks: Sequence[str],
    prose: str | None = None,
    samples: int = 50,
    seed: int = 0,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    checkpointing=None,
    protocol: str = QUERY_AWARE,
) -> list[RulerResult]:
    """Every task x context length x policy on the same `samples` prompts per task (`Generator(tokenizer,
    prose)`: prose, the text of the prose haystack, for the tasks that need it), greedy as RULER decodes; the
    arguments as `passkey.sweep`'s. The prompts are built and checked first (`plan`: distinct tasks and
    lengths, prompts that fill them), and with them the `protocol` (`jcascade.eval.protocol`): "query-aware"
    compresses each prompt whole, "query-agnostic" its context alone (prompt[:question_start]), the question
    read after it.

    policies: {label: policy}, or a function of the context length returning it (`passkey.policies_by_length`;
    e.g. `policy_grid`, policies at a budget). The prompts of all tasks at a length are right-padded to
    [batch_size, context_length] (rows repeated) and continued by the most tokens any of the tasks generates;
    each output is then cut to its task's `tokens_to_generate` (greedy decoding: the same tokens as generating
    that many), so each (policy, length) compiles once. progress(n) after each batch with its number of
    prompts (None: a tqdm bar of the prompts on stderr). checkpointing (`checkpointing.Checkpointing`):
    results saved every `every` tokens (prompts times the context length), and a run continues from its last
    checkpoint (same batch size, protocol and prompts, its units this sweep's first ones:
    `checkpointing.finished`), the units it holds not run again. Raises a RuntimeError unless the results hold
    every planned unit once (`checkpointing.complete`).
    """
    from jcascade.eval.passkey import policies_by_length, progress_bar

    for name, value in (("samples", samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    generator = Generator(tokenizer, prose)
    planned = plan(generator, tasks, context_lengths, samples, seed, model)
    at = policies_by_length(policies, list(planned))
    check(protocol, [p for n in planned for p in at(n).values()], getattr(model, "config", None))
    units = [(label, task, n, i) for n in planned for label in at(n) for task in tasks for i in range(samples)]
    key = lambda r: (r.policy, r.task, r.context_length, r.index)
    with progress_bar(progress, len(units), "RULER", "prompt") as progress:
        results = []
        found = (
            checkpointing.resume(
                batch_size=batch_size,
                protocol=protocol,
                prompts=prompts_sha256((s.prompt, s.question_start) for n in planned for s in planned[n]),
            )
            if checkpointing is not None
            else None
        )
        if found is not None:
            results = finished(found[1], units, RulerResult, key)
            progress(len(results))
        done, reached = len(results), 0  # the units the checkpoint holds, the units up to this batch
        longest = max(TASKS[t].tokens_to_generate for t in tasks)
        pending = []  # (label, length, prompts, this process's outputs) of the batches not gathered yet

        def gather_pending():
            for (label, length, part, _), out in zip(pending, gather_batches([o for *_, o in pending], model)):
                for s, ids in zip(part, out):
                    ids = ids[: TASKS[s.task].tokens_to_generate]
                    text = tokenizer.decode(ids[ids >= 0], skip_special_tokens=True)
                    results.append(
                        RulerResult(
                            label, s.task, length, s.index, len(s.prompt), text, string_match_all(text, s.answers)
                        )
                    )
            pending.clear()

        for length, prompts in planned.items():
            question_width = max(len(s.prompt) - s.question_start for s in prompts)
            for label, policy in at(length).items():
                for first in range(0, len(prompts), batch_size):
                    part = prompts[first : first + batch_size]
                    reached += len(part)
                    if reached <= done:
                        continue
                    rows = [part[i % len(part)] for i in range(batch_size)]
                    pending.append(
                        (
                            label,
                            length,
                            part,
                            generate(
                                model,
                                policy,
                                [s.prompt for s in rows],
                                [s.question_start for s in rows],
                                protocol,
                                width=length,
                                question_width=question_width,
                                max_new_tokens=longest,
                                eos_id=tokenizer.eos_token_id,
                            ),
                        )
                    )
                    progress(len(part))
                    if checkpointing is not None and checkpointing.due(len(part) * length):
                        gather_pending()
                        checkpointing.save(None, {"results": [dataclasses.asdict(r) for r in results]})
        gather_pending()
        complete(results, units, key, "RULER sweep")
        return results
