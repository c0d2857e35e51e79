"""KVzip against an oracle: transformers' Llama (float64) re-reads the prompt behind the same reconstruction prompts,
and each cached token's score is recomputed from the layer's queries and keys as kvpress's KVzipPress does; each KV
head then keeps its sinks and best-scored tokens."""

import dataclasses
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
from jcascade import generation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 61
POLICY = jc.KVzip(
    budget=9, instruction=(1, 2, 3, 4), continuation=(5, 6), turn=(7, 8), chunk=12, overlap=3, sinks=2, skip=3, stride=8
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=100.0,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the default initialisation gives, so scores are far from ties
        for name, parameter in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                parameter.mul_(8.0)
    path = tmp_path_factory.mktemp("kvzip-llama")
    hf.save_pretrained(path)
    return hf.double(), jc.load_pretrained(path)


def oracle_scores(hf, ids: list[int], policy) -> np.ndarray:
    """float64 [layers, KV heads, len(ids)]: the reconstruction pass in transformers, scored from each layer's
    queries (rotated at the pass's positions) over the sinks, the chunk's cached keys and the pass's own keys."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg, L = hf.config, len(ids)
    H, G, D = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    cache_argument = "cache" if "cache" in inspect.signature(hf.model.forward).parameters else "past_key_values"
    scores = np.zeros((cfg.num_hidden_layers, H, L))
    for c, first in enumerate(range(policy.skip, L, policy.chunk)):
        end = min(first + policy.chunk, L)
        head = policy.instruction if c == 0 else policy.continuation + tuple(ids[first - policy.overlap : first])
        row = list(head) + list(policy.turn) + ids[first:end]
        sinks = min(policy.sinks, first)
        found, cache = {}, transformers.DynamicCache()
        with torch.no_grad():  # the prompt's cache, afresh for each chunk (the pass adds to it)
            hf.model(input_ids=torch.tensor([ids]), **{cache_argument: cache})

        def hook(module, args, kwargs, output, found=found, cache=cache):
            x = kwargs["hidden_states"]
            q = module.q_proj(x).view(1, len(row), -1, D).transpose(1, 2)
            cos, sin = kwargs["position_embeddings"]
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            keys = cache.layers[module.layer_idx].keys[0]  # [H, L + len(row), D], rotated
            keys = torch.cat([keys[:, :sinks], keys[:, first:end], keys[:, L:]], dim=1)
            logits = torch.einsum("hgtd,hsd->hgts", q[0].view(H, G, len(row), D), keys) / D**0.5
            causal = torch.ones(len(row), len(row), dtype=torch.bool).tril()
            allowed = torch.cat([torch.ones(len(row), sinks + end - first, dtype=torch.bool), causal], dim=1)
            weights = torch.softmax(logits.masked_fill(~allowed, -torch.inf), dim=-1)
            found[module.layer_idx] = weights[..., sinks : sinks + end - first].amax(dim=(1, 2)).numpy()

        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in hf.model.layers]
        with torch.no_grad():
            hf.model(input_ids=torch.tensor([row]), **{cache_argument: cache})
        for h in hooks:
            h.remove()
        for layer, s in found.items():
            scores[layer, :, first:end] = s
    return scores


def kept(scores: np.ndarray, sinks: int, budget: int, allocation: str = "head") -> list[list[list[int]]]:
    """[layer][KV head] kept positions: each head's best `budget`, or ("global") the best budget x layers x heads of
    all of them (ties: the lower layer, head, position first)."""
    ranked = np.where(np.arange(scores.shape[-1]) < sinks, np.inf, scores)
    if allocation == "head":
        return [[sorted(np.argsort(-head, kind="stable")[:budget].tolist()) for head in layer] for layer in ranked]
    chosen = np.zeros(ranked.size, bool)
    chosen[np.argsort(-ranked.ravel(), kind="stable")[: budget * ranked.shape[0] * ranked.shape[1]]] = True
    return [[np.flatnonzero(head).tolist() for head in layer] for layer in chosen.reshape(ranked.shape)]


def test_kvzip_scores_and_keeps_as_the_oracle(models):
    hf, model = models
    rng = np.random.default_rng(1)
    lengths = np.array([40, 23])  # after 3 skipped tokens, four chunks (the last partial) and two: ragged rows
    tokens = rng.integers(9, VOCAB, (2, 40))
    scored = POLICY.after_prompt(
        model,
        generation._prompt(model, dataclasses.replace(POLICY, budget=64), jnp.asarray(tokens), jnp.asarray(lengths), 0)[
            0
        ],
        jnp.asarray(tokens),
        jnp.asarray(lengths),
    )
    held = {
        allocation: np.asarray(
            generation._prompt(
                model, dataclasses.replace(POLICY, allocation=allocation), jnp.asarray(tokens), jnp.asarray(lengths), 2
            )[0].cache.pos
        )
        for allocation in ("head", "global")
    }
    assert held["head"].shape[-1] == POLICY.budget + 2 and held["global"].shape[-1] == 40 + 2
    for b, n in enumerate(lengths):
        want = oracle_scores(hf, tokens[b, :n].tolist(), POLICY)
        got = np.asarray(scored.cache.score)[:, b, :, :n]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
        for allocation, pos in held.items():
            assert [[sorted(p[p >= 0].tolist()) for p in layer] for layer in pos[:, b]] == kept(
                want, POLICY.sinks, POLICY.budget, allocation
            ), allocation
    counts = (held["global"] >= 0).sum(-1)  # [layers, rows, heads]: the heads keep different counts
    assert (counts.sum((0, 2)) == 2 * 2 * POLICY.budget).all() and counts.min() != counts.max()


def test_kvzip_through_score_and_generate(models):
    _, model = models
    tokens = np.random.default_rng(2).integers(9, VOCAB, (2, 36))
    whole = np.asarray(jc.score(model, tokens, dataclasses.replace(POLICY, budget=64), prefix=30))
    np.testing.assert_allclose(whole, np.asarray(jc.score(model, tokens, jc.Full(stride=8))), atol=1e-5)
    assert np.isfinite(np.asarray(jc.score(model, tokens, POLICY, prefix=30))).all()
    assert jc.generate(model, tokens[:, :30], POLICY, max_new_tokens=3).shape == (2, 3)
    spread = dataclasses.replace(POLICY, allocation="global")
    assert np.isfinite(np.asarray(jc.score(model, tokens, spread, prefix=30))).all()
    assert jc.generate(model, tokens[:, :30], spread, max_new_tokens=3).shape == (2, 3)


def test_kvzip_for_tokenizer_builds_kvpress_prompts():
    import tiny

    tok = tiny.tokenizer()
    policy = jc.KVzip.for_tokenizer(tok, 16, chunk=64)
    assert tok.decode(policy.instruction) == "\n\nRepeat the previous context exactly."
    assert tok.decode(policy.continuation).startswith("\n\nRepeat the part of the previous context exactly")
    assert tok.decode(policy.turn) == "<|end|><|assistant|>"
    assert policy.skip == len(tok.encode("<|user|>", add_special_tokens=False))
    assert (policy.budget, policy.chunk) == (16, 64)
    plain = jc.KVzip.for_tokenizer(tiny.tokenizer(chat=False), 16)
    assert tiny.tokenizer(chat=False).decode(plain.turn) == "\n" and plain.skip == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(budget=0), "budget must be >= 1"),
        (dict(budget=4, instruction=[1, 2]), "instruction must be a tuple of token ids"),
        (dict(budget=4, turn=(1, -2)), "turn must be a tuple of token ids"),
        (dict(budget=4, chunk=4, overlap=5), "overlap must be <= chunk"),
        (dict(budget=4, allocation="layer"), "allocation must be one of"),
    ],
)
def test_kvzip_refuses_bad_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        jc.KVzip(**fields)
