"""RULER's synthetic tasks (jcascade.eval.ruler): determinism, answers recoverable from the prompt alone,
needles where the generator says, prompt lengths, and the scorer on hand-written outputs."""

import collections
import re

import numpy as np
import pytest

import tiny
from jcascade.eval import ruler

PROSE = " ".join(f"Sentence number {i} of the prose tells of the {w} river." for i, w in
                 enumerate(["quiet", "broad", "cold", "winding", "dark"] * 400))


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
        assert s.text[offset: offset + len(sentence)] == sentence
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
    assert list(policies) == ["Full", "Sink 25%", "Cascade 25%", "H2O 25%", "SnapKV 25%", "PyramidKV 25%", "TOVA 25%",
                              "KNorm 25%", "AdaKV-SnapKV 25%", "ExpectedAttention 25%", "KVzip 25%"]
    for label, policy in policies.items():
        if label != "Full":
            slots = policy.scorer.budget if isinstance(policy, jc.AdaKV) else policy.budget if isinstance(
                policy, (jc.SnapKV, jc.PyramidKV, jc.KNorm, jc.ExpectedAttention, jc.KVzip)) else policy.cache_slots(None)
            assert slots == 2048, (label, slots)
    assert ruler.policies_at(["sink"], 4096, 16384)["Sink 4096"].cache_slots(None) == 4096
    with pytest.raises(ValueError, match="kvzip needs the tokenizer"):
        ruler.policies_at(["kvzip"], 0.25, 8192)
    assert ruler.task_list("all") == list(ruler.TASKS) and ruler.budget_list("0.25,2048") == [0.25, 2048.0]
    for call, match in [(lambda: ruler.budget_slots(0.01, 4096), "at least 128"),
                        (lambda: ruler.task_list("niah_single_1,qa_1"), "tasks must be comma-separated names"),
                        (lambda: ruler.policy_list("full,quest"), "policies must be"),
                        (lambda: ruler.budget_list("0.25,-1"), "budgets must be"),
                        (lambda: ruler.budget_list("half"), "budgets must be")]:
        with pytest.raises(ValueError, match=match):
            call()


def test_the_report_averages_tasks_and_pairs_prompts():
    from jcascade.eval import report

    def results(label, scores):  # 2 tasks x 10 prompts at one length
        return [ruler.RulerResult(label, task, 4096, i, 4000, "", scores[t * 10 + i])
                for t, task in enumerate(("vt", "cwe")) for i in range(10)]

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
    policies = lambda n: {"Sink": jc.Sink(window=96, sinks=4, stride=128)}  # noqa: E731
    both = ruler.sweep(model, generator, ["vt", "niah_single_1"], [1024], policies, samples=2, batch_size=4)
    alone = ruler.sweep(model, generator, ["vt"], [1024], policies, samples=2, batch_size=4)
    assert [r.output for r in both if r.task == "vt"] == [r.output for r in alone]
    assert len(both) == 4 and all(0 <= r.score <= 1 for r in both)


def test_a_sweep_cut_short_resumes_where_its_checkpoint_ends(tmp_path):
    """A checkpoint holds the batches recorded before the stop, a resume with another batch size is refused, and the
    resumed sweep ends with the same results as one never interrupted."""
    import jcascade as jc
    from jcascade.eval.checkpointing import Checkpointing, load_stream

    generator = ruler.Generator(tiny.tokenizer())
    model = tiny.model(len(generator.tokenizer))
    policies = lambda n: {"Sink": jc.Sink(window=96, sinks=4, stride=128)}  # noqa: E731
    sweep = lambda **kw: ruler.sweep(model, generator, ["vt"], [1024], policies, samples=6, batch_size=2, **kw)  # noqa: E731
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
        ruler.sweep(model, generator, ["vt"], [1024], policies, samples=6, batch_size=3,
                    checkpointing=Checkpointing(tmp_path, 1, {"run": 1}))
    resumed = sweep(checkpointing=Checkpointing(tmp_path, 1, {"run": 1}))
    assert resumed == whole
