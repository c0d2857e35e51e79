"""The evaluation helpers check their arguments at the door: a wrong type or an empty input is a TypeError or
ValueError naming the argument and what it expects, never an error from inside numpy, str or a dependency."""

import pytest
import tiny

import jcascade as jc
from jcascade.eval import report, ruler
from jcascade.eval.passkey import PasskeyResult

POLICIES = {"Full": jc.Full(), "Sink": jc.Sink(window=64)}


def passkey_result(policy: str, sample: int, accuracy: float = 1.0) -> PasskeyResult:
    return PasskeyResult(
        policy=policy,
        context_length=256,
        bucket=0,
        sample=sample,
        key="12345",
        depth=0.5,
        prompt_tokens=250,
        answer="12345",
        accuracy=accuracy,
        key_tokens=4,
        retention=None,
    )


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: ruler.string_match_all("the answer is ab", "ab"),
            TypeError,
            r"answers must be a sequence of expected "
            r"strings \(e.g. \['ab'\]\), got str",
        ),
        (lambda: ruler.string_match_all("out", [b"ab"]), TypeError, r"answers must be strings, got \['bytes'\]"),
        (lambda: ruler.string_match_all(None, ["ab"]), TypeError, "output must be the generated text"),
        (lambda: ruler.string_match_all("out", []), ValueError, "answers must name at least one expected string"),
        (
            lambda: report.passkey([], POLICIES),
            ValueError,
            r"results is empty: a report needs at least one "
            r"PasskeyResult \(as passkey.sweep returns\)",
        ),
        (lambda: report.ruler("results", POLICIES), TypeError, "results must be a sequence of RulerResult"),
        (
            lambda: report.perplexity([passkey_result("Full", 0)], POLICIES),
            TypeError,
            "results must hold BookPerplexitys .* got a PasskeyResult",
        ),
        (
            lambda: report.passkey([passkey_result("Full", 0), passkey_result("Sink", 1)], POLICIES),
            ValueError,
            "policy 'Sink' shares no prompt with the baseline 'Full': a paired difference compares the same prompts",
        ),
        (
            lambda: ruler.Generator(tiny.tokenizer(), prose=b"Of man's first disobedience"),
            TypeError,
            r"prose must be text \(a str; decode bytes first\) or None, got bytes",
        ),
        (
            lambda: jc.KVzip.for_tokenizer(None, 64),
            TypeError,
            "KVzip.for_tokenizer: tokenizer must be a Hugging Face tokenizer",
        ),
    ],
    ids=[
        "answers as one string",
        "answers as bytes",
        "no output",
        "no answers",
        "no passkey results",
        "ruler results as a string",
        "another command's results",
        "no prompt shared with the baseline",
        "a bytes book",
        "no tokenizer for KVzip",
    ],
)
def test_a_wrong_argument_is_named_with_what_it_expects(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_model_directory_without_a_tokenizer_names_itself_and_the_files_looked_for(tmp_path):
    jc.save_converted(tiny.model(32), tmp_path / "model")
    with pytest.raises(
        ValueError,
        match=r"model: the model directory holds no tokenizer \(none of tokenizer.json, "
        r"tokenizer.model, vocab.json",
    ):
        jc.load_tokenizer(tmp_path / "model")
