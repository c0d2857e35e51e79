"""A sharded model (weights by `jc.models.shard`, caches with rows over "data" and KV heads over "model",
each layer's attend/update under shard_map) gives what one device gives, on 8 emulated CPU devices in a
subprocess (the device count is fixed when jax starts), and on 2 processes x 4 devices (multi-controller)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

MESHES = [(2, 4), (8, 1), (1, 4)]
TINY = dict(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4)  # 96 tokens


@pytest.mark.slow
def test_sharded_score_and_generate_equal_one_device(tmp_path):
    import jax.numpy as jnp

    import jcascade as jc
    import tiny

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, __file__, str(tmp_path / "sharded")], env=env, capture_output=True, text=True,
                         timeout=1200, cwd=pathlib.Path(__file__).parent)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results["cases"]) == 5 + 3 + 3
    for case in results["cases"]:
        assert case["score_max_abs_diff"] <= 1e-4, case
        assert case["generate_equal"], case
        assert case["cache_spec"] == case["expected_cache_spec"], case
    assert results["cache_all_gathers"] == [], results["cache_all_gathers"]
    assert "replicated along it" in results["warning"]
    assert len(results["readme_out"]) == 8  # the README's snippet ran as written
    assert results["loaded_as_sharded"]  # jc.load_pretrained(path, mesh=) places weights as shard() does
    # the GPU and TPU Pallas kernels per shard (interpret mode) against one device's XLA attention
    assert results["kernels"] == {"triton": True, "mosaic_tpu": True}  # generate per shard equals one device
    shared = results["shared_prefix"]  # num_samples: the prompts' caches as shared prefixes, per shard
    assert shared["per_shard"] == [True, True, False], shared
    assert shared["xla_equal"] and shared["triton_equal"] and shared["three_prompts_equal"], shared
    assert results["embed_equal"] == [True, True]
    assert results["random_on_mesh"]
    cli = results["cli"]  # jcascade passkey: default mesh (rows over all 8 devices), --mesh data=2,model=2, one device
    assert cli["meshes"] == ["data=8,model=1", "data=2,model=2", "one device"], cli
    assert cli["answers_equal"] and cli["rows"] == 2 * 5, cli
    # a checkpoint saved from the (2, 4)-sharded model loads onto this process's one device
    loaded = jc.load_pretrained(tmp_path / "sharded", dtype=jnp.float32)
    model = tiny.model(96, **TINY)
    for name, w in loaded.weights().items():
        assert len(w.sharding.device_set) == 1 and bool((w == model.weights()[name]).all()), name


@pytest.mark.slow
def test_two_processes_give_the_one_process_result(tmp_path):
    """2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives), one (2, 4) mesh: the model
    restored from a converted checkpoint straight into its shards, score and greedy generate as on one device."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec

    import jcascade as jc
    import tiny

    model = tiny.model(96, **TINY)
    jc.save_converted(model, tmp_path / "model")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    workers = [subprocess.Popen([sys.executable, __file__, "worker", str(i), str(port), str(tmp_path / "model")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=pathlib.Path(__file__).parent) for i in range(2)]
    outputs = [w.communicate(timeout=600) for w in workers]
    for w, (_, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [r["process"] for r in results] == [0, 1] and all(r["devices"] == [8, 4] for r in results)
    tokens, lengths = _inputs()
    for policy in _multiprocess_policies():
        name = type(policy).__name__
        score = jc.score(model, tokens, policy, lengths=lengths, prefix=24 if policy.needs_prompt else None)
        generated = jc.generate(model, tokens[:, :24], policy, max_new_tokens=6, lengths=np.minimum(lengths, 24))
        for r in results:  # each process gathered the whole result
            assert np.max(np.abs(np.asarray(score) - np.array(r[name]["score"]))) <= 1e-4, name
            assert (np.asarray(generated) == np.array(r[name]["generate"])).all(), name
            assert r[name]["cache_spec"] == str(PartitionSpec(None, "data", "model", None, None))
        assert not jnp.isnan(score).any()


def _inputs():
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, 96, (8, 40)).astype(np.int32)
    return tokens, np.array([40, 31, 40, 12, 25, 40, 38, 20], np.int32)


def _multiprocess_policies():
    import jcascade as jc

    return [jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8), jc.SnapKV(budget=12, window=4, stride=16)]


def worker(process: int, port: int, checkpoint: str):
    """One of 2 processes: the README's multi-host recipe on a (2, 4) mesh over both processes' devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    import jcascade as jc

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    model = jc.load_pretrained(checkpoint, mesh=mesh)
    tokens, lengths = _inputs()  # the same host values on every process
    results = dict(process=jax.process_index(), devices=[len(jax.devices()), len(jax.local_devices())])
    for policy in _multiprocess_policies():
        score = jc.score(model, tokens, policy, lengths=lengths, prefix=24 if policy.needs_prompt else None)
        generated = jc.generate(model, tokens[:, :24], policy, max_new_tokens=6, lengths=np.minimum(lengths, 24))
        results[type(policy).__name__] = dict(
            score=np.asarray(multihost_utils.process_allgather(score, tiled=True)).tolist(),
            generate=np.asarray(multihost_utils.process_allgather(generated, tiled=True)).tolist(),
            cache_spec=str(model.init_cache(policy, 8, max_tokens=64).k.sharding.spec))
    print(json.dumps(results))


def test_a_mesh_needs_the_data_and_model_axes():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jcascade as jc
    import tiny

    with pytest.raises(ValueError, match=r"axes \('data', 'model'\)"):
        jc.models.shard(tiny.model(97), Mesh(np.array(jax.devices()[:1]), ("x",)))


def three_prompts_equal(model, policy, tokens, lengths) -> bool:
    """A decode step of 6 rows over 3 prompts' caches as one shared-prefix level (2 rows each), on a (3, 2)
    mesh (prefix rows over "data", per shard) and on one device: the same hidden states."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jcascade as jc

    prompts, _, _ = jc.prefill(model, policy, model.init_cache(policy, 3), tokens[:3, :30], jnp.minimum(lengths[:3], 30))
    level = jax.vmap(lambda layer: jc.share_prefix(policy, layer))(prompts)
    own = jc.Full(stride=policy.stride)

    def step(m):
        return jax.jit(lambda level: m(own, m.init_cache(own, 6, max_tokens=4), tokens[:6, 30:31], jnp.ones(6, jnp.int32),
                                       None, (level,))[0])(level)

    sharded = jc.models.shard(model, Mesh(np.array(jax.devices()[:6]).reshape(3, 2), ("data", "model")))
    return float(jnp.max(jnp.abs(step(model) - step(sharded)))) <= 1e-5


def main(saved_sharded: str):
    """Runs on 8 CPU devices; saves the (2, 4)-sharded model as a converted checkpoint at `saved_sharded`."""
    import contextlib
    import io
    import re
    import tempfile
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jcascade as jc
    import tiny
    from jcascade import cli
    from jcascade.models import sharding

    assert len(jax.devices()) == 8
    model = tiny.model(96, **TINY)
    tokens, lengths = (jnp.asarray(x) for x in _inputs())
    policies = [jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8), jc.Sink(window=12, sinks=2, stride=8),
                jc.H2O(heavy=6, recent=6, stride=8), jc.SnapKV(budget=12, window=4, stride=16),
                jc.Recycled(top_k=6, refresh_every=3, stride=16)]
    gen = lambda m, policy: jc.generate(m, tokens[:, :24], policy, max_new_tokens=6, lengths=jnp.minimum(lengths, 24))
    prefix = lambda policy: 24 if policy.needs_prompt else None
    one_device = {type(p).__name__: (jc.score(model, tokens, p, lengths=lengths, prefix=prefix(p)), gen(model, p))
                  for p in policies}
    cases = []
    for shape in MESHES:  # every policy on (2, 4); Cascade, H2O and Recycled on the others
        mesh = Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("data", "model"))
        sharded = jc.models.shard(model, mesh)
        for policy in policies if shape == MESHES[0] else policies[0::2]:
            score, generated = one_device[type(policy).__name__]
            cache = sharded.init_cache(policy, 8, max_tokens=64)
            cases.append(dict(mesh=shape, policy=type(policy).__name__,
                              score_max_abs_diff=float(jnp.max(jnp.abs(
                                  score - jc.score(sharded, tokens, policy, lengths=lengths, prefix=prefix(policy))))),
                              generate_equal=bool((generated == gen(sharded, policy)).all()),
                              cache_spec=str(cache.k.sharding.spec),
                              expected_cache_spec=str(jax.sharding.PartitionSpec(None, "data", "model", None, None))))
    # the Pallas kernels (Triton and Mosaic TPU, interpret mode) run per shard under shard_map: a generate runs
    # the chunk kernels with scores (the prompt) and the decode ones (short inputs: interpret mode is slow)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sharded, policy = jc.models.shard(model, mesh), policies[0]
    gen_short = lambda m, **kw: jc.generate(m, tokens[:, :16], policy, max_new_tokens=3,  # noqa: E731
                                            lengths=jnp.minimum(lengths, 16), **kw)
    generated = gen_short(model)
    kernels = {backend: bool((generated == gen_short(sharded, implementation=backend)).all())
               for backend in ("triton", "mosaic_tpu")}
    # num_samples: the prompt's cache is a shared prefix (one row, replicated over "data") under shard_map
    one, samples = tokens[:1, :30], dict(max_new_tokens=6, temperature=1.0, num_samples=8, rng=jax.random.key(3))
    expected = jc.generate(model, one, policy, **samples)
    prompt = jax.tree.map(lambda x: x[0], sharded.init_cache(policy, 1))  # layer 0 of a prompt's cache
    level = jax.tree.map(lambda x: x[None], jc.share_prefix(policy, prompt))
    three_rows = jax.tree.map(lambda x: jnp.repeat(x, 3, axis=1), level)
    shared_prefix = dict(per_shard=[sharding.layer_specs(8, 4, mesh, (level,)) is not None,
                                    sharding.layer_specs(6, 4, Mesh(np.array(jax.devices()[:6]).reshape(3, 2),
                                                                    ("data", "model")), (three_rows,)) is not None,
                                    sharding.layer_specs(8, 4, mesh, (three_rows,)) is not None],
                         xla_equal=bool((expected == jc.generate(sharded, one, policy, **samples)).all()),
                         triton_equal=bool((expected == jc.generate(sharded, one, policy, implementation="triton",
                                                                     **samples)).all()),
                         three_prompts_equal=three_prompts_equal(model, policy, tokens, lengths))
    # the decode step of a sharded generate moves no cache between devices
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sharded = jc.models.shard(model, mesh)
    policy = policies[0]
    capacity = sharded.init_cache(policy, 8).capacity
    text = jax.jit(lambda t: jc.generate(sharded, t, policy, max_new_tokens=4)).lower(tokens).compile().as_text()
    gathers = [line.strip()[:200] for line in text.splitlines()
               if re.search(r"all-gather(-start)?\(", line) and re.search(rf"\[[^\]]*\b{capacity}\b[^\]]*\]", line)]
    with tempfile.TemporaryDirectory() as directory:  # loading straight into the shardings
        jc.save_converted(model, directory)
        loaded = jc.load_pretrained(directory, dtype=jnp.float32, mesh=mesh)
    loaded_as_sharded = all(w.sharding == sharded.weights()[name].sharding and bool((w == model.weights()[name]).all())
                            for name, w in loaded.weights().items())
    jc.save_converted(sharded, saved_sharded)  # the test loads it on one device
    # the vocabulary-split embedding: each device looks up its own rows (tokens at every shard border)
    rows = model.config.vocab_size // 4
    border = jnp.asarray([[0, rows - 1, rows, 2 * rows - 1, 2 * rows, 3 * rows, 4 * rows - 1, 5]] * 2, jnp.int32)
    embed_equal = [bool((sharding.embed(sharded.embed[...], t, mesh, sharded.embed_spec)
                         == jnp.take(model.embed[...], t, axis=0)).all()) for t in (border, tokens)]
    # random weights made on their shards: the shard() placement, the values of one device's (fp32 ulps)
    made = jc.CausalLM.random(model.config, jax.random.key(5), mesh=mesh)
    single = jc.CausalLM.random(model.config, jax.random.key(5))
    random_on_mesh = all(w.sharding == sharded.weights()[name].sharding and
                         float(jnp.max(jnp.abs(w - single.weights()[name]))) <= 1e-6
                         for name, w in made.weights().items())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jc.models.shard(tiny.model(97, num_heads=6, num_kv_heads=3), Mesh(np.array(jax.devices()[:2]).reshape(1, 2),
                                                                         ("data", "model")))
    cli_runs = {}
    with tempfile.TemporaryDirectory() as directory:  # the CLI: the default mesh and --mesh give the same answers
        tiny.save(pathlib.Path(directory) / "model")
        for mesh_option in ([], ["--mesh", "data=2,model=2"], ["--mesh", "data=1,model=1"]):
            out = pathlib.Path(directory) / f"out{len(cli_runs)}"
            with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
                cli.main(["passkey", "--model", str(pathlib.Path(directory) / "model"), "--policy",
                          "cascade:cache_size=32,sinks=4,stride=32", "--policy", "sink:window=32,sinks=4,stride=32",
                          "--min-length", "128", "--max-length", "128", "--samples", "1", "--out", str(out),
                          *mesh_option])
            used = re.search(r"mesh (data=\d+,model=\d+)", err.getvalue())
            used = used.group(1) if used else "one device"
            cli_runs[used] = [(r["policy"], r["answer"]) for r in json.loads((out / "passkey.json").read_text())["results"]]
    runs = list(cli_runs.values())
    cli_result = dict(meshes=list(cli_runs), rows=len(runs[0]), answers_equal=all(r == runs[0] for r in runs))
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    snippet = readme.split("## Multi-device", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # as written
    print(json.dumps(dict(cases=cases, cache_all_gathers=gathers, warning=" ".join(str(w.message) for w in caught),
                          readme_out=np.asarray(namespace["out"]).tolist(), loaded_as_sharded=loaded_as_sharded,
                          kernels=kernels, shared_prefix=shared_prefix, cli=cli_result, embed_equal=embed_equal,
                          random_on_mesh=random_on_mesh)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main(sys.argv[1])
