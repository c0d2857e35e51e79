"""RULER's synthetic tasks (jcascade.eval.ruler): determinism, answers recoverable from the prompt alone,
needles where the generator says, prompt lengths, and the scorer on hand-written outputs."""

import collections
import contextlib
import json
import math
import re
from unittest import mock

import numpy as np
import pytest
import tiny
from hypothesis import example, given
from hypothesis import strategies as st
from jcascade.models.config import FAMILY_FEATURES, Rotary

from jcascade.eval import ruler

PROSE = " ".join(
    f"Sentence number {i} of the prose tells of the {w} river."
    for i, w in enumerate(["quiet", "broad", "cold", "winding", "dark"] * 400)
)


@pytest.fixture(scope="module")
def generator():
    return ruler.Generator(tiny.tokenizer(), PROSE)


def test_samples_are_deterministic_by_seed(generator):
    a, b = generator.sample("niah_multikey_1", 2048, 3, seed=7), generator.sample("niah_multikey_1", 2048, 3, seed=7)
    assert a.text == b.text and np.array_equal(a.prompt, b.prompt) and a.answers == b.answers
    assert generator.sample("niah_multikey_1", 2048, 3, seed=8).answers != a.answers
    assert generator.sample("niah_multikey_1", 2048, 4, seed=7).answers != a.answers
    fresh = ruler.Generator(tiny.tokenizer(), PROSE)  # a sample depends on nothing drawn before it
    assert fresh.sample("niah_multikey_1", 2048, 3, seed=7).text == a.text


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if ruler.TASKS[t].family == "niah"])
def test_needles_sit_where_the_generator_says_and_hold_the_answers(generator, task):
    spec, s = ruler.TASKS[task], generator.sample(task, 2048, 1)
    for sentence, offset in s.needles:
        assert s.text[offset : offset + len(sentence)] == sentence
    assert len(s.needles) == max(spec.num_keys, spec.num_queries) * spec.num_values
    question = s.text.rsplit("\n", 1)[1]
    asked = re.findall(r"for (.+?) is: (.+?)\.$", "\n".join(n for n, _ in s.needles), re.M)
    found = [value for key, value in asked if key in question]  # the needles of the keys the question names
    assert sorted(found) == sorted(s.answers) and len(s.answers) == spec.num_queries * spec.num_values
    assert s.text.count(s.answers[0]) == 1  # the value is in the prompt once, in its needle
    assert s.answer_prefix.endswith(" is" if spec.num_queries * spec.num_values == 1 else " are")


def test_variable_tracking_answers_follow_the_chain(generator):
    s = generator.sample("vt", 2048, 0)
    task = s.text.split("\n\n", 2)[2]  # after the one-shot example and the instruction
    value = re.search(r"assigned the value (\d+)", task).group(1)
    holds, assignments = set(), re.findall(r"VAR (\w+) = (?:VAR (\w+)|(\d+))", task)
    for name, source, number in assignments * len(assignments):  # a fixed point: every name holding the value
        if number == value or source in holds:
            holds.add(name)
    assert holds == set(s.answers) and len(s.answers) == 5
    assert s.answer_prefix.endswith(f"5 variables are assgined the value {value}, they are: ")


@pytest.mark.parametrize("task,length,common", [("cwe", 16384, 30), ("cwe", 2048, 6)])
def test_common_words_are_the_answers(generator, task, length, common):
    s = generator.sample(task, length, 0)
    listed = s.text.rsplit("\nQuestion:", 1)[0].rsplit("in the list are:", 1)[1].split("\n", 1)[1]
    counts = collections.Counter(re.findall(r"\d+\. (.+?)(?= \d+\. |$)", listed.split("\n", 1)[1]))
    assert {w for w, c in counts.items() if c == common} == set(s.answers) and len(s.answers) == 10
    assert set(counts.values()) == {common, 3 if length >= 4096 else 1}


def test_frequent_words_are_the_answers(generator):
    s = generator.sample("fwe", 4096, 2)
    counts = collections.Counter(s.text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and tuple(ranked[1:4]) == s.answers
    assert counts[ranked[1]] > counts[ranked[2]] > counts[ranked[3]] > counts[ranked[4]]


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_prompts_fill_the_context_within_a_units_slack(generator, task):
    length = 16384 if task == "cwe" else 2048
    s, spec = generator.sample(task, length, 0), ruler.TASKS[task]
    used = len(s.prompt) + spec.tokens_to_generate
    assert used <= length and used > length - 200, used
    text = generator.tokenizer.decode(s.prompt)
    assert text.startswith("<|user|>") and text.endswith("<|assistant|>" + s.answer_prefix)  # chat, then prefix


def test_the_scorer_is_rulers_string_match_all():
    assert ruler.string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert ruler.string_match_all("The numbers are 111 and 333", ["111", "222", "333", "444"]) == 0.5
    assert ruler.string_match_all("KKNXU, qgmlh", ["kknxu", "QGMLH", "ZZZZZ"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("", ["a"]) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        ruler.string_match_all("x", [])


def test_bad_requests_are_refused(generator):
    with pytest.raises(ValueError, match="task must be one of"):
        generator.sample("qa_1", 2048, 0)
    with pytest.raises(ValueError, match="give the Generator a prose text"):
        ruler.Generator(tiny.tokenizer()).sample("niah_single_2", 2048, 0)
    with pytest.raises(ValueError, match="too short for niah_single_1"):
        generator.sample("niah_single_1", 100, 0)


def test_every_policy_keeps_the_budget():
    import jcascade as jc

    policies = ruler.policies_at(ruler.POLICIES, 0.25, 8192, tiny.tokenizer())  # 2048 slots, sinks and windows included
    assert list(policies) == [
        "Full",
        "Sink 25%",
        "Cascade 25%",
        "H2O 25%",
        "SnapKV 25%",
        "PyramidKV 25%",
        "TOVA 25%",
        "KNorm 25%",
        "AdaKV-SnapKV 25%",
        "ExpectedAttention 25%",
        "KVzip 25%",
        "KVzip-head 25%",
    ]
    for label, policy in policies.items():
        if label != "Full":
            slots = (
                policy.scorer.budget
                if isinstance(policy, jc.AdaKV)
                else policy.budget
                if isinstance(policy, (jc.SnapKV, jc.PyramidKV, jc.KNorm, jc.ExpectedAttention, jc.KVzip))
                else policy.cache_slots(None)
            )
            assert slots == 2048, (label, slots)
    assert policies["KVzip 25%"].allocation == "global" and policies["KVzip-head 25%"].allocation == "head"
    assert ruler.policies_at(["sink"], 4096, 16384)["Sink 4096"].cache_slots(None) == 4096
    with pytest.raises(ValueError, match="kvzip needs the tokenizer"):
        ruler.policies_at(["kvzip"], 0.25, 8192)
    assert ruler.task_list("all") == list(ruler.TASKS) and ruler.budget_list("0.25,2048") == [0.25, 2048.0]
    for call, match in [
        (lambda: ruler.budget_slots(0.01, 4096), "at least 128"),
        (lambda: ruler.task_list("niah_single_1,qa_1"), "tasks must be comma-separated names"),
        (lambda: ruler.policy_list("full,quest"), "policies must be"),
        (lambda: ruler.budget_list("0.25,-1"), "budgets must be"),
        (lambda: ruler.budget_list("half"), "budgets must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_the_report_averages_tasks_and_pairs_prompts():
    from jcascade.eval import report

    def results(label, scores):  # 2 tasks x 10 prompts at one length
        return [
            ruler.RulerResult(label, task, 4096, i, 4000, "", scores[t * 10 + i])
            for t, task in enumerate(("vt", "cwe"))
            for i in range(10)
        ]

    full, cascade = [1.0] * 20, [1.0] * 10 + [0.0, 1.0] * 5
    rep = report.ruler(results("Full", full) + results("Cascade 25%", cascade), {"Full": "Full()", "Cascade 25%": "C"})
    assert rep["baseline"] == "Full" and rep["prompts"] == {"4096": 20}
    assert rep["average"]["Cascade 25%"]["4096"]["value"] == 0.75 and rep["average"]["Full"]["4096"]["n"] == 20
    assert rep["scores"]["Cascade 25%"]["cwe"]["4096"]["value"] == 0.5
    difference = rep["differences"]["Cascade 25%"]["all"]
    assert difference["value"] == -0.25 and difference["high"] < 0 and rep["verdicts"] == {"Cascade 25%": "worse"}
    assert "RULER: Cascade 25% - Full = -0.25" in report.ruler_text(rep)


def test_outputs_cut_to_the_tasks_length_equal_generating_that_many(generator):
    """The sweep continues all tasks' prompts by the longest answer (128 tokens) and cuts each output to its
    task's tokens_to_generate (vt: 30): the same outputs as a sweep of vt alone."""
    import jcascade as jc

    model = tiny.model(len(generator.tokenizer))
    policies = lambda n: {"Sink": jc.Sink(window=96, sinks=4, stride=128)}
    both = ruler.sweep(
        model,
        generator.tokenizer,
        policies,
        [1024],
        tasks=["vt", "niah_single_1"],
        prose=PROSE,
        samples=2,
        batch_size=4,
    )
    alone = ruler.sweep(model, generator.tokenizer, policies, [1024], tasks=["vt"], samples=2, batch_size=4)
    assert [r.output for r in both if r.task == "vt"] == [r.output for r in alone]
    assert len(both) == 4 and all(0 <= r.score <= 1 for r in both)


def test_a_sweep_cut_short_resumes_where_its_checkpoint_ends(tmp_path):
    """A checkpoint holds the batches recorded before the stop, a resume with another batch size or protocol is
    refused, and the resumed sweep ends with the same results as one never interrupted."""
    import jcascade as jc
    from jcascade.eval.checkpointing import Checkpointing, load_stream

    tokenizer = tiny.tokenizer()
    model = tiny.model(len(tokenizer))
    policies = {"Sink": jc.Sink(window=96, sinks=4, stride=128)}
    sweep = lambda **kw: ruler.sweep(model, tokenizer, policies, [1024], tasks=["vt"], samples=6, batch_size=2, **kw)
    whole = sweep()
    done = []

    def stop_after_two(n):
        done.append(n)
        if len(done) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(progress=stop_after_two, checkpointing=Checkpointing(tmp_path, 1, {"run": 1}))
    saved = load_stream(tmp_path)[1]
    assert len(saved["results"]) == 2  # stopped while recording the second batch
    with pytest.raises(ValueError, match=r"differs in \(saved, now\): batch_size \(2, 3\)\. Resume with"):
        ruler.sweep(
            model,
            tokenizer,
            policies,
            [1024],
            tasks=["vt"],
            samples=6,
            batch_size=3,
            checkpointing=Checkpointing(tmp_path, 1, {"run": 1}),
        )
    with pytest.raises(ValueError, match=r"differs in \(saved, now\): protocol \(.query-aware., .query-agnostic.\)"):
        sweep(checkpointing=Checkpointing(tmp_path, 1, {"run": 1}), protocol="query-agnostic")
    resumed = sweep(checkpointing=Checkpointing(tmp_path, 1, {"run": 1}))
    assert resumed == whole


# ---- counts that mean what they say: distinct units, prompts that fill their context, bounded searches -------


def test_units_given_twice_are_refused_by_name():
    for call, match in [
        (lambda: ruler.task_list("vt,niah_single_1,vt"), "tasks: 'vt' is given twice"),
        (lambda: ruler.policy_list("full,sink,full"), "policies: 'full' is given twice"),
        (lambda: ruler.budget_list("0.25,0.5,0.25"), "budgets: 0.25 is given twice"),
        (lambda: ruler.policies_at(["sink", "sink"], 0.25, 8192), "policies: 'sink' is given twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    # distinct budgets get distinct labels (a dict of labels would otherwise keep one of them)
    labels = [next(iter(ruler.policies_at(["sink"], b, 8192))) for b in (0.25, 0.251, 0.252, 2048)]
    assert labels == ["Sink 25%", "Sink 25.1%", "Sink 25.2%", "Sink 2048"]


def test_a_sweep_refuses_repeated_tasks_and_lengths_before_any_model_time(generator):
    """model=None: a sweep that reached the model would fail otherwise than with these ValueErrors."""
    policies = lambda n: {"Full": None}
    for tasks, lengths, match in [
        (["vt", "vt"], [1024], "tasks: 'vt' is given twice"),
        (["vt"], [1024, 2048, 1024], "context_lengths: 1024 is given twice"),
        (["vt"], [1024, 0], "context_lengths must be a non-empty list of ints >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            ruler.sweep(None, generator.tokenizer, policies, lengths, tasks=tasks, samples=1)


def test_a_haystack_that_cannot_fill_the_context_is_refused_with_the_numbers():
    short = ruler.Generator(tiny.tokenizer(), PROSE[:2000])  # 35 sentences: about 1,400 tokens of prose
    assert len(short.sample("niah_single_2", 512, 0).prompt) > 512 - 128 - 60  # it fills a short context
    with pytest.raises(
        ValueError,
        match=r"niah_single_2 at context_length=2048: all \d+ sentences of the prose "
        r"make a prompt of \d+ tokens \+ 128 to generate, short of the 2048 asked",
    ):
        short.sample("niah_single_2", 2048, 0)
    # all lengths are checked before the first generate call (model=None would fail otherwise)
    with pytest.raises(ValueError, match="short of the 2048 asked"):
        ruler.sweep(
            None,
            short.tokenizer,
            {"Full": None},
            [512, 2048],
            tasks=["niah_single_1", "niah_single_2"],
            prose=PROSE[:2000],
            samples=1,
        )
    few_words = ruler.Generator(tiny.tokenizer())
    few_words.lists["cwe"] = few_words.lists["cwe"][:40]
    with pytest.raises(ValueError, match=r"cwe at context_length=2048: all 40 words of cwe's list make a prompt"):
        few_words.sample("cwe", 2048, 0)
    for empty in ("", " \n\n "):
        with pytest.raises(ValueError, match="prose haystack holds no text"):
            ruler.Generator(tiny.tokenizer(), empty)


def test_fwe_refuses_a_prompt_whose_answers_are_not_the_three_most_frequent_words(generator):
    with pytest.raises(ValueError, match=r"too short for fwe: its largest prompt \(\d+ tokens\) holds too few words"):
        generator.sample("fwe", 300, 0)  # a few coded words: the three after "..." tie with the rest (or are absent)
    s = generator.sample("fwe", 1024, 0)
    counts = collections.Counter(s.text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split())
    others = [c for w, c in counts.items() if w != "..." and w not in s.answers]
    assert min(counts[a] for a in s.answers) > max(others, default=0)


def _plateau_tokenizer():
    """A tokenizer in which fwe's prompt with one noise word "..." takes as many tokens as with none."""
    tok = tiny.tokenizer(text=f"{tiny.TEXT} {ruler.FWE} ... ... ...")
    assert len(tok(ruler.FWE.format(context=""))["input_ids"]) == len(tok(ruler.FWE.format(context="..."))["input_ids"])
    return tok


@contextlib.contextmanager
def _recorded_builds():
    """[(units, text, answer prefix)] of every prompt a generator builds inside the block."""
    built, originals = [], dict(ruler._GENERATORS)

    def recording(family):
        def build(task, units, *rest):
            assert units <= 10**6, f"{family}: a prompt of {units} units asked for"  # the unbounded search's mark
            out = originals[family](task, units, *rest)
            built.append((units, *out[:2]))
            return out

        return build

    with mock.patch.dict(ruler._GENERATORS, {f: recording(f) for f in originals}):
        yield built


def test_fwe_ends_where_its_first_units_add_no_tokens():
    """fwe's first units add at most a "...", which this tokenizer folds into the white space before the
    question: the search measured 0 tokens per unit and asked for ~1e11 units (unbounded memory)."""
    generator = ruler.Generator(_plateau_tokenizer())
    for length in range(200, 420, 20):
        with _recorded_builds() as built:
            try:
                generator.sample("fwe", length, 0)
            except ValueError as e:
                assert "context_length" in str(e)
        assert max(units for units, *_ in built) <= 2 * length + 2, length


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_the_prompt_is_the_largest_that_fits_whatever_the_search_saw_before(generator, task):
    """A prompt's tokens grow with its units (cwe: a longer list holds a shorter one's words), so the sample is
    the one unit count whose prompt fits where one more does not: no count up to 8 more fits either, and a
    generator that sampled this task and length before (the search starts from that sample's count) finds the
    same prompt as a fresh one. The search also stays near the answer: cwe's first units (below 11 words) add no
    tokens, where it once asked for the whole word list (a text 20 times the prompt's)."""
    length, spec = (16384 if task == "cwe" else 2048), ruler.TASKS[task]
    fresh = ruler.Generator(tiny.tokenizer(), PROSE)
    with _recorded_builds() as built:
        s = fresh.sample(task, length, 1)
    units = next(u for u, text, _ in built if text == s.text)
    assert max(len(text) for _, text, _ in built) < 4 * len(s.text)
    for more in range(units + 1, min(units + 9, 2 * length)):
        assert len(fresh.build(task, length, 1, 0, more).prompt) > length - spec.tokens_to_generate, (units, more)
    warm = ruler.Generator(tiny.tokenizer(), PROSE)
    warm.sample(task, length, 0)
    assert warm.sample(task, length, 1).text == s.text


def test_a_search_that_cannot_converge_raises_with_the_numbers():
    """A tokenizer that drops every lowercase letter and "." (no unknown token): fwe's coded words add nothing."""
    generator = ruler.Generator(
        tiny.tokenizer(chat=False, text="THE GRASS IS GREEN QUESTION WHAT ANSWER", byte_level=False)
    )
    with (
        _recorded_builds(),
        pytest.raises(
            ValueError,
            match=r"fwe at context_length=1000: the search for the "
            r"prompt's size cannot converge: 1902 units make a prompt",
        ),
    ):
        generator.sample("fwe", 1000, 0)


@pytest.fixture(scope="module")
def generators():
    return {"plain": ruler.Generator(tiny.tokenizer(), PROSE[:4000]), "plateau": ruler.Generator(_plateau_tokenizer())}


@example(length=2048, task="niah_single_2", which="plain").via("the prose runs out")
@example(length=300, task="fwe", which="plateau").via("units add no tokens")
@given(
    length=st.one_of(st.integers(100, 600), st.integers(600, 3000)),
    task=st.sampled_from(["fwe", "cwe", "vt", "niah_single_1", "niah_multikey_2", "niah_single_2"]),
    which=st.sampled_from(["plain", "plateau"]),
)
def test_the_prompt_search_is_bounded_and_finds_the_largest_prompt(generators, length, task, which):
    """Within 9 + 2 log2(most) tokenizations and never more units than `most` (the haystack's, or what the
    context can hold): the prompt with the most units that fits (one more does not, or the haystack ran out
    within a unit of the context), or a ValueError saying why none fits."""
    generator, spec = generators[which], ruler.TASKS[task]
    if spec.needs_prose and generator.prose is None:
        return
    budget = length - spec.tokens_to_generate
    most = (
        len(generator.prose) if spec.needs_prose else len(generator.lists["cwe"]) if task == "cwe" else 2 * budget + 2
    )
    with _recorded_builds() as built:
        try:
            s = generator.sample(task, length, 0)
        except ValueError as e:
            assert f"context_length={length}" in str(e)
            s = None
    assert len(built) <= 10 + 2 * math.log2(max(most, 1)) and max(units for units, *_ in built) <= max(most, 1)
    if s is not None:
        assert len(s.prompt) <= budget and s.answers
        units = next(u for u, text, _ in built if text == s.text)
        assert units + 1 in [u for u, *_ in built] or units == most
        if units == most:  # the haystack ran out: the prompt is within a unit (on average) of the context
            smallest = len(generator._prompt(*built[0][1:])[0])
            assert budget - len(s.prompt) < (len(s.prompt) - smallest) / max(most - 1, 1)


# ---- the protocols: the question apart from its context ----------------------------------------------------


@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("chat", [True, False])
def test_the_question_starts_where_the_text_asks_it(generator, task, chat):
    """question_start splits the prompt, whose ids are the templated text's, where RULER's final question
    begins ("What is/are ...", "Question: ..."): one token earlier the question would start with the haystack's
    end, one later inside its first word."""
    if not chat:
        generator = ruler.Generator(tiny.tokenizer(chat=False), PROSE)
    tok, s = generator.tokenizer, generator.sample(task, 2048, 1)
    head = (
        tok.apply_chat_template([{"role": "user", "content": s.text}], add_generation_prompt=True, tokenize=False)
        if chat
        else s.text
    )
    assert s.prompt.tolist() == tok(head + s.answer_prefix, add_special_tokens=not chat)["input_ids"]
    context, question = tok.decode(s.prompt[: s.question_start]), tok.decode(s.prompt[s.question_start :])
    assert context + question == tok.decode(s.prompt) and 0 < s.question_start < len(s.prompt)
    assert question.startswith("Question: " if ruler.TASKS[task].family != "niah" else ("What is ", "What are "))
    assert question.endswith(s.answer_prefix) and context.endswith("\n")


def test_a_slow_tokenizer_is_refused():
    from transformers import PreTrainedTokenizer

    slow = mock.create_autospec(PreTrainedTokenizer, instance=True, is_fast=False)
    with pytest.raises(ValueError, match="only a fast"):
        ruler.Generator(slow)


def test_the_protocols_agree_when_every_token_is_kept_and_differ_when_the_question_is_compressed(generator):
    """Both protocols' sweeps of 2 tasks x 2 prompts at 512 tokens. Under Full the context's cache holds every
    token, so the question read after it equals the whole prompt (the same ids, split): the same greedy answers.
    SnapKV keeping 128 of ~380 tokens: its observation window holds the question's end under query-aware, the
    context's end under query-agnostic, so the answers differ."""
    import jcascade as jc

    model = tiny.model(len(generator.tokenizer))
    full, snapkv = jc.Full(stride=128), jc.SnapKV(budget=128, window=8, stride=128)
    policies = lambda n: {"Full": full, "SnapKV": snapkv}
    sweeps = {
        protocol: ruler.sweep(
            model,
            generator.tokenizer,
            policies,
            [512],
            samples=2,
            batch_size=4,
            tasks=["niah_single_1", "niah_multikey_2"],
            protocol=protocol,
        )
        for protocol in ("query-aware", "query-agnostic")
    }
    aware, agnostic = ([r for r in sweeps[p] if r.policy == "Full"] for p in ("query-aware", "query-agnostic"))
    assert len(aware) == 4 and [r.output for r in agnostic] == [r.output for r in aware]
    assert [r.prompt_tokens for r in agnostic] == [r.prompt_tokens for r in aware]
    aware, agnostic = ([r.output for r in sweeps[p] if r.policy == "SnapKV"] for p in ("query-aware", "query-agnostic"))
    assert aware != agnostic


def test_query_agnostic_refuses_what_cannot_be_a_frozen_context_before_any_model_time(generator):
    """model=None: a sweep that reached the model would fail otherwise."""
    import jcascade as jc

    recycled = lambda n: {"Recycled": jc.Recycled(top_k=64, refresh_every=8, stride=32)}
    with pytest.raises(ValueError, match="protocol query-agnostic does not support Recycled"):
        ruler.sweep(
            None, generator.tokenizer, recycled, [512], tasks=["niah_single_1"], samples=1, protocol="query-agnostic"
        )
    from jcascade.eval import protocol

    for starts, width in (([0], 8), ([5], 8), ([2], 2)):  # an empty context or question, a question over its width
        with pytest.raises(ValueError, match="question_starts must split each prompt into a context and a question"):
            protocol.generate(
                None,
                jc.Full(),
                [np.arange(5)],
                starts,
                "query-agnostic",
                width=8,
                question_width=width,
                max_new_tokens=1,
                eos_id=None,
            )
    with pytest.raises(ValueError, match="protocol must be one of query-aware, query-agnostic"):
        ruler.sweep(None, generator.tokenizer, recycled, [512], tasks=["niah_single_1"], samples=1, protocol="agnostic")
    gemma = tiny.model(
        len(generator.tokenizer),
        architecture="gemma3",
        **FAMILY_FEATURES["gemma3"],
        num_layers=2,
        sliding_window=24,
        layer_types=("sliding", "global"),
        rotary=Rotary(theta=10000.0, local_theta=10000.0),
    )
    with pytest.raises(ValueError, match="not supported yet for models with sliding or linear layers"):
        ruler.sweep(
            gemma,
            generator.tokenizer,
            {"Full": jc.Full()},
            [512],
            tasks=["niah_single_1"],
            samples=1,
            protocol="query-agnostic",
        )


def test_kvpress_compression_ratios_are_kept_fractions_labelled_apart():
    """kvpress's ratios 0.25 / 0.5 / 0.75 / 0.875 keep 1 - ratio: --budget 0.75,0.5,0.25,0.125."""
    budgets = ruler.budget_list("0.75,0.5,0.25,0.125")
    policies = {k: v for b in budgets for k, v in ruler.policies_at(["snapkv"], b, 4096).items()}
    assert {k: v.budget for k, v in policies.items()} == {
        "SnapKV 75%": 3072,
        "SnapKV 50%": 2048,
        "SnapKV 25%": 1024,
        "SnapKV 12.5%": 512,
    }


# ---- one way to name and pass policies: specs or budget-scaled names, the same sweep API as passkey's -----------


def test_policy_option_takes_names_scaled_at_each_budget_and_specs_used_as_given():
    import jcascade as jc

    assert ruler.policy_list("full, snapkv") == ["full", "snapkv"]
    assert ruler.policy_list("sink:window=1000,sinks=4") == [jc.Sink(window=1000, sinks=4)]  # commas inside a spec
    with pytest.raises(ValueError, match="or a spec NAME:FIELD=VALUE"):
        ruler.policy_list("slidingwindow")
    grid = ruler.policy_grid(["sink", jc.SnapKV(budget=300), "full"], [0.25, 0.5])
    assert list(grid(4096)) == ["Sink 25%", "Sink 50%", "SnapKV 300", "Full"]  # in the order given
    assert grid(4096)["Sink 25%"].cache_slots(None) == 1024 and grid(8192)["Sink 25%"].cache_slots(None) == 2048
    assert grid(4096)["SnapKV 300"] == grid(8192)["SnapKV 300"] == jc.SnapKV(budget=300)
    for policies, match in [
        (["full", jc.Full(stride=64)], "two policies are labelled 'Full'"),
        (["sink", "sink"], "policies: 'sink' is given twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            ruler.policy_grid(policies, [0.25])(4096)


def test_names_run_at_every_storage_format_labelled_apart():
    import jcascade as jc

    grid = ruler.policy_grid(
        ["full", "adakv", jc.Sink(window=300, kv_dtype="int8")],
        [0.25],
        kv_dtypes=ruler.kv_dtype_list("model,int8,float8_e4m3fn"),
    )(4096)
    assert {k: p.kv_dtype for k, p in grid.items()} == {
        "Full": "model",
        "Full int8": "int8",
        "Full float8_e4m3fn": "float8_e4m3fn",
        "AdaKV-SnapKV 25%": "model",
        "AdaKV-SnapKV 25% int8": "int8",
        "AdaKV-SnapKV 25% float8_e4m3fn": "float8_e4m3fn",
        "Sink 300 int8": "int8",
    }  # a spec keeps its own
    assert grid["AdaKV-SnapKV 25% int8"].scorer == jc.SnapKV(budget=1024, stride=2048, kv_dtype="int8")
    for text, match in [("int8,int8", "kv_dtypes: 'int8' is given twice"), ("int4", "kv_dtypes must be .* among")]:
        with pytest.raises(ValueError, match=match):
            ruler.kv_dtype_list(text)


def test_sweeps_take_policies_as_a_mapping_or_a_function_of_the_length_with_fixed_labels(generator):
    """model=None: the checks come before any model time."""
    import jcascade as jc
    from jcascade.eval import passkey

    moving = lambda n: {f"Sink {n}": jc.Sink(window=n // 4)}
    for sweep in (
        lambda p: ruler.sweep(None, generator.tokenizer, p, [1024, 2048], tasks=["vt"], samples=1),
        lambda p: passkey.sweep(None, generator.tokenizer, p, [512, 1024]),
    ):
        with pytest.raises(ValueError, match="the labels must be the same at every context length"):
            sweep(moving)
        with pytest.raises(ValueError, match=r"policies must be \{label: policy\} or a function"):
            sweep([jc.Full()])
        with pytest.raises(ValueError, match="policies must name at least one policy"):
            sweep({})


def test_the_report_of_a_sweep_holds_specs_that_read_back():
    """report.ruler takes the policies as swept ({label: policy} or a function of the length) and writes specs."""
    import jcascade as jc
    from jcascade.eval import report
    from jcascade.policies import parse_policy

    results = [
        ruler.RulerResult(label, "vt", n, i, n - 10, "", 1.0)
        for label in ("Full", "Sink 25%")
        for n in (512, 1024)
        for i in range(5)
    ]
    grid = ruler.policy_grid(["full", "sink"], [0.25])
    rep = report.ruler(results, grid)
    assert {k: {int(n): parse_policy(v) for n, v in by_length.items()} for k, by_length in rep["policies"].items()} == {
        k: {n: grid(n)[k] for n in (512, 1024)} for k in ("Full", "Sink 25%")
    }
    fixed = {"Full": jc.Full(), "Sink 25%": jc.Sink(window=64)}
    rep = report.ruler(results, fixed)
    assert {k: parse_policy(v) for k, v in json.loads(report.json_text(rep))["policies"].items()} == fixed
