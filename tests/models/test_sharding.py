"""A sharded model (weights by `jc.models.shard`, caches with rows over "data" and KV heads over "model",
each layer's attend/update under shard_map) gives what one device gives, on 8 emulated CPU devices: every test
here is marked `devices(8)` and runs in a pytest process started with them (tests/conftest.py). Two processes
x 4 devices: test_sharding_multiprocess.py."""

import contextlib
import dataclasses
import io
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_families
import tiny
from jax.sharding import Mesh, PartitionSpec
from jcascade.models import sharding
from jcascade.models.config import FAMILY_FEATURES, Attention, Rotary

import jcascade as jc
from jcascade import cli

pytestmark = pytest.mark.devices(8)

TINY = dict(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4)  # 96 tokens
CACHE_SPEC = PartitionSpec(None, "data", "model", None, None)  # [layer, rows, KV heads, slots, head_dim]
# On the (2, 4) mesh: the policies whose state or rules reach across rows, KV heads or layers (AdaKV's budget
# shared by a layer's heads, KVzip's and Recycled's whole-model decisions, Expected Attention's statistics) and one
# of each cache layout (Cascade's rings, H2O's scores; AdaKV's prompt selection is SnapKV's, per head: Sink, TOVA
# and KNorm act on each row and KV head alone as SnapKV does; tests/policies holds their rules). On the data-only
# and model-only meshes, Cascade (a mesh axis of one device is the (2, 4) code path with that axis unsplit).
POLICIES = {
    type(p).__name__: p
    for p in [
        jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8),
        jc.H2O(heavy=6, recent=6, stride=8),
        jc.Recycled(top_k=6, refresh_every=3, stride=16),
        jc.AdaKV(jc.SnapKV(budget=12, window=4, stride=16)),
        jc.KVzip(budget=12, instruction=(1, 2, 3), continuation=(4,), turn=(5,), chunk=16, stride=16),
        jc.ExpectedAttention(budget=12, window=4, future=16, sinks=2, stride=16),
    ]
}
CASCADE = POLICIES["Cascade"]
CASES = [((2, 4), name) for name in POLICIES] + [((8, 1), "Cascade"), ((1, 4), "Cascade")]


def inputs():
    """8 ragged rows of 40 tokens."""
    tokens = np.random.default_rng(0).integers(0, 96, (8, 40)).astype(np.int32)
    return tokens, np.array([40, 31, 40, 12, 25, 40, 38, 20], np.int32)


def scored(model, policy):
    """Log-probs of inputs() after a 24-token prompt: the prompt prefilled in chunks (and compressed, for a policy
    that acts after it), then one decode step per token, teacher-forced: the path generate takes (its loop and
    sampling: test_sharded_generate_equals_one_device)."""
    tokens, lengths = inputs()
    return jc.score(model, tokens, policy, lengths=lengths, prefix=24)


def mesh_of(shape) -> Mesh:
    return Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("data", "model"))


@pytest.fixture(scope="module")
def model():
    assert len(jax.devices()) == 8
    return tiny.model(96, **TINY)


@pytest.fixture(scope="module")
def sharded(model):
    """The model on the (2, 4) mesh."""
    return jc.models.shard(model, mesh_of((2, 4)))


@pytest.fixture(scope="module")
def one_device(model):
    """name -> the log-probs (`scored`) of that policy on one device, computed once."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = scored(model, POLICIES[name])
        return done[name]

    return get


@pytest.mark.parametrize("shape,name", CASES, ids=[f"{d}x{m}-{name}" for (d, m), name in CASES])
def test_sharded_score_equals_one_device(model, one_device, shape, name):
    policy = POLICIES[name]
    sharded = jc.models.shard(model, mesh_of(shape))
    assert sharded.init_cache(policy, 8, max_tokens=64).cache.k.data.sharding.spec == CACHE_SPEC
    np.testing.assert_allclose(scored(sharded, policy), one_device(name), rtol=1e-5, atol=1e-4)  # log-probs up to ~20


def test_sharded_generate_equals_one_device(model, sharded):
    """generate's loop (greedy tokens from vocabulary-split logits, eos, its output) on the (2, 4) mesh."""
    tokens, lengths = inputs()

    def generate(m):
        return jc.generate(m, tokens[:, :24], CASCADE, max_new_tokens=6, lengths=np.minimum(lengths, 24))

    np.testing.assert_array_equal(generate(sharded), generate(model))


GEMMA3 = dict(
    architecture="gemma3",
    **FAMILY_FEATURES["gemma3"],
    layer_types=("sliding", "global"),
    sliding_window=8,
    rotary=Rotary(theta=10000.0, local_theta=10000.0),
    attention=Attention(query_scale=0.3),
    sliding_policy=jc.H2O(heavy=3, recent=2, positions="original"),
)


@pytest.mark.parametrize(
    "family",
    [
        dict(architecture="qwen2", **FAMILY_FEATURES["qwen2"], attention=Attention(qkv_bias=True)),
        GEMMA3,
        dict(architecture="qwen3", **FAMILY_FEATURES["qwen3"]),
        test_families.QWEN3_5,
        test_families.GEMMA4,
        test_families.SMOLLM3,
        test_families.OLMO3,
    ],
    ids=["qwen2", "gemma3", "qwen3", "qwen3_5", "gemma4", "smollm3", "olmo3"],
)
def test_each_family_sharded_equals_one_device(family):
    """The weights a family adds (Qwen2's biases, Gemma 3's norms, Qwen3's q/k norms, Qwen3.5's head_dim of its own
    and Gated DeltaNet (replicated, its states' rows over "data"), Gemma 4's global-layer weights and per-layer
    inputs, OLMo 3's q/k norms over all heads) follow their logical axes onto the mesh; Gemma 3's sliding layers too,
    under a policy of their own (H2O; the default window cache is SlidingWindow through the same code), and SmolLM3's
    layer without rotary positions."""
    family = dict(family)
    sliding_policy = family.pop("sliding_policy", None)
    # Gemma 4's per-layer inputs add a unit-RMS vector in every layer: at the others' weight scale (0.5) its random
    # logits amplify the mesh's other summation order to 2e-4 .. 2e-3 (2e-5 at 0.3)
    scale = 0.3 if family["architecture"] == "gemma4" else 0.5
    model = tiny.model(96, seed=1, scale=scale, **TINY | family).with_sliding_policy(sliding_policy)
    want = scored(model, CASCADE)
    assert float(jnp.max(jnp.abs(scored(jc.models.shard(model, mesh_of((2, 4))), CASCADE) - want))) <= 1e-4


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_the_kernels_run_per_shard(model, sharded, backend):
    """The Pallas kernels (interpret mode) under shard_map: a generate runs the chunk kernels with scores (the
    prompt) and the decode ones, and equals one device's XLA attention (short inputs: interpret mode is slow)."""
    tokens, lengths = (x[[0, 3]] for x in inputs())  # one row per data shard, one of them shorter than the prompt
    generate = lambda m, **kw: jc.generate(
        m, tokens[:, :16], CASCADE, max_new_tokens=3, lengths=np.minimum(lengths, 16), **kw
    )
    np.testing.assert_array_equal(generate(sharded.with_kernels(jc.Kernels(backend))), generate(model))


def test_shared_prefix_levels_run_per_shard_when_their_rows_allow(sharded):
    """A level of one row (replicated over "data") or of rows that divide over "data" runs under shard_map;
    3 rows over a data axis of 2 do not."""
    prompt = jax.tree.map(lambda x: x[0], sharded.init_cache(CASCADE, 1).cache)  # layer 0 of a prompt's cache
    level = jax.tree.map(lambda x: x[None], jc.share_prefix(CASCADE, prompt))
    three_rows = jax.tree.map(lambda x: jnp.repeat(x, 3, axis=1), level)
    requests = lambda batch: jc.init_cache(CASCADE, batch, 4, 16, num_layers=2)  # a stacked cache
    assert sharding.layer_specs(requests(8), mesh_of((2, 4)), (level,)) is not None
    assert sharding.layer_specs(requests(6), mesh_of((3, 2)), (three_rows,)) is not None
    assert sharding.layer_specs(requests(8), mesh_of((2, 4)), (three_rows,)) is None


@pytest.mark.parametrize("backend, kv_dtype", [("xla", "model"), ("triton", "model"), ("triton", "int8")])
def test_num_samples_share_the_prompt_per_shard(model, sharded, backend, kv_dtype):
    """num_samples: the prompt's cache is a shared prefix (one row, replicated over "data") under shard_map (an int8
    prefix's codes and scales split over "model" with its KV heads)."""
    one = inputs()[0][:1, :30]
    policy = dataclasses.replace(CASCADE, kv_dtype=kv_dtype)
    samples = dict(max_new_tokens=6, temperature=1.0, num_samples=4, rng=jax.random.key(3))  # 2 rows per data shard
    np.testing.assert_array_equal(
        jc.generate(sharded.with_kernels(jc.Kernels(backend)), one, policy, **samples),
        jc.generate(model, one, policy, **samples),
    )


def test_three_prompts_as_one_shared_level_per_shard(model):
    """A decode step of 6 rows over 3 prompts' caches as one shared-prefix level (2 rows each), on a (3, 2)
    mesh (prefix rows over "data", per shard) and on one device: the same hidden states."""
    tokens, lengths = (jnp.asarray(x) for x in inputs())
    prompts, _, _ = jc.prefill(
        model, CASCADE, model.init_cache(CASCADE, 3), tokens[:3, :30], jnp.minimum(lengths[:3], 30)
    )
    level = jax.vmap(lambda layer: jc.share_prefix(CASCADE, layer))(prompts.cache)
    own = jc.Full(stride=CASCADE.stride)

    def step(m):
        return jax.jit(
            lambda level: m(
                own, m.init_cache(own, 6, max_tokens=4), tokens[:6, 30:31], jnp.ones(6, jnp.int32), (level,)
            )[0]
        )(level)

    sharded = jc.models.shard(model, mesh_of((3, 2)))
    assert float(jnp.max(jnp.abs(step(model) - step(sharded)))) <= 1e-5


def test_a_sharded_decode_step_moves_no_cache(sharded):
    """No all-gather of a cache-sized array in a compiled sharded generate."""
    capacity = sharded.init_cache(CASCADE, 8).cache.capacity
    tokens = jnp.asarray(inputs()[0])
    text = jax.jit(lambda t: jc.generate(sharded, t, CASCADE, max_new_tokens=4)).lower(tokens).compile().as_text()
    gathers = [
        line.strip()[:200]
        for line in text.splitlines()
        if re.search(r"all-gather(-start)?\(", line) and re.search(rf"\[[^\]]*\b{capacity}\b[^\]]*\]", line)
    ]
    assert gathers == []


def test_a_checkpoint_loads_straight_into_its_shards(model, sharded, tmp_path):
    """jc.load_pretrained(path, mesh=) places the weights as shard() does."""
    jc.save_converted(model, tmp_path)
    loaded = jc.load_pretrained(tmp_path, dtype=jnp.float32, mesh=sharded.mesh)
    for name, w in loaded.weights().items():
        assert w.sharding == sharded.weights()[name].sharding and bool((w == model.weights()[name]).all()), name


def test_a_checkpoint_saved_sharded_loads_onto_one_device(model, sharded, tmp_path):
    jc.save_converted(sharded, tmp_path)
    loaded = jc.load_pretrained(tmp_path, dtype=jnp.float32)
    for name, w in loaded.weights().items():
        assert len(w.sharding.device_set) == 1 and bool((w == model.weights()[name]).all()), name


@pytest.mark.parametrize("which", ["shard borders", "tokens"])
def test_the_vocabulary_split_embedding_looks_up_each_devices_own_rows(model, sharded, which):
    rows = model.config.vocab_size // 4
    border = jnp.asarray([[0, rows - 1, rows, 2 * rows - 1, 2 * rows, 3 * rows, 4 * rows - 1, 5]] * 2, jnp.int32)
    t = border if which == "shard borders" else jnp.asarray(inputs()[0])
    got = sharding.embed(sharded.embed[...], t, sharded.mesh, sharded.embed_spec)
    np.testing.assert_array_equal(got, jnp.take(model.embed[...], t, axis=0))


def test_random_weights_are_made_on_their_shards(model, sharded):
    """The shard() placement, the values of one device's (fp32 ulps)."""
    made = jc.CausalLM.random(model.config, jax.random.key(5), mesh=sharded.mesh)
    single = jc.CausalLM.random(model.config, jax.random.key(5))
    for name, w in made.weights().items():
        assert w.sharding == sharded.weights()[name].sharding, name
        assert float(jnp.max(jnp.abs(w - single.weights()[name]))) <= 1e-6, name


def test_heads_that_do_not_divide_are_replicated_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jc.models.shard(tiny.model(97, num_heads=6, num_kv_heads=3), mesh_of((1, 2)))
    assert "replicated along it" in " ".join(str(w.message) for w in caught)


@pytest.mark.parametrize(
    "shape,heads",
    [((2, 4), dict(num_heads=6, num_kv_heads=3)), ((3, 2), {})],
    ids=["3 KV heads over model=4", "8 rows over data=3"],
)
def test_rows_or_kv_heads_that_do_not_divide_run_per_shard_replicated(shape, heads):
    """Attention still runs under shard_map with the axis that does not divide replicated (each of its devices
    repeats the rows or heads it holds whole): specs for every layer, one device's log-probs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weights' replication warning (test above)
        model = tiny.model(96, seed=2, **TINY | heads)
        sharded = jc.models.shard(model, mesh_of(shape))
    specs = sharding.layer_specs(sharded.init_cache(CASCADE, 8, max_tokens=64).cache, sharded.mesh)
    assert specs is not None and specs["chunk"] == (
        PartitionSpec("data", None, None, None) if heads else PartitionSpec(None, None, "model", None)
    )
    np.testing.assert_allclose(scored(sharded, CASCADE), scored(model, CASCADE), rtol=1e-5, atol=1e-4)


def test_a_mesh_needs_the_data_and_model_axes():
    with pytest.raises(ValueError, match=r"axes \('data', 'model'\)"):
        jc.models.shard(tiny.model(97), Mesh(np.array(jax.devices()[:1]), ("x",)))


@pytest.fixture(scope="module")
def passkey(model_dir, tmp_path_factory):
    """--mesh option -> (the (data, model) shape of the mesh the CLI ran on, None for one device; [(policy,
    answer)] of its rows)."""
    out, done = tmp_path_factory.mktemp("passkey"), {}

    def run(option):
        key = " ".join(option)
        if key not in done:
            meshes = []

            def device_mesh(*args, **kwargs):
                meshes.append(real(*args, **kwargs))
                return meshes[-1]

            real = sharding.device_mesh
            with (
                pytest.MonkeyPatch.context() as patch,
                contextlib.redirect_stderr(io.StringIO()),
                contextlib.redirect_stdout(io.StringIO()),
            ):
                patch.setattr(sharding, "device_mesh", device_mesh)
                cli.main(
                    [
                        "passkey",
                        "--model",
                        model_dir,
                        "--policy",
                        "cascade:cache_size=32,sinks=4,stride=32",
                        "--min-length",
                        "128",
                        "--max-length",
                        "128",
                        "--samples",
                        "1",
                        "--out",
                        str(out / str(len(done))),
                        *option,
                    ]
                )
            (mesh,) = meshes
            results = json.loads((out / str(len(done)) / "passkey.json").read_text())["results"]
            done[key] = (
                mesh and (mesh.shape["data"], mesh.shape["model"]),
                [(r["policy"], r["answer"]) for r in results],
            )
        return done[key]

    return run


@pytest.mark.parametrize(
    "option,mesh", [([], (8, 1)), (["--mesh", "data=2,model=2"], (2, 2))], ids=["default", "data=2,model=2"]
)
def test_the_cli_on_a_mesh_answers_as_on_one_device(passkey, option, mesh):
    """jcascade passkey splits its rows over every device by default, or over the --mesh given: the same answers
    as on one device."""
    used, answers = passkey(option)
    alone, expected = passkey(["--mesh", "data=1,model=1"])
    assert used == mesh and alone is None
    assert len(expected) == 5 and answers == expected


def test_ruler_on_a_mesh_answers_as_on_one_device(model_dir, tmp_path):
    """jcascade ruler splits each batch's rows over every device by default: the outputs of one device."""

    def outputs(*option):
        out = tmp_path / str(len(option))
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            cli.main(
                [
                    "ruler",
                    "--model",
                    model_dir,
                    "--tasks",
                    "niah_single_1,vt",
                    "--policy",
                    "cascade",
                    "--budget",
                    "0.25",
                    "--min-length",
                    "1K",
                    "--max-length",
                    "1K",
                    "--samples",
                    "6",
                    "--out",
                    str(out),
                    *option,
                ]
            )
        results = json.loads((out / "ruler.json").read_text())["results"]
        return [(r["policy"], r["task"], r["index"], r["output"]) for r in results]

    sharded = outputs()
    assert len(sharded) == 2 * 6 and sharded == outputs("--mesh", "data=1,model=1")
