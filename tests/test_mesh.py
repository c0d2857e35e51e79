"""A sharded model (weights by `jc.models.shard`, caches with rows over "data" and KV heads over "model",
each layer's attend/update under shard_map) gives what one device gives, on 8 emulated CPU devices in a
subprocess (the device count is fixed when jax starts)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

MESHES = [(2, 4), (8, 1), (1, 4)]


@pytest.mark.slow
def test_sharded_score_and_generate_equal_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1200,
                         cwd=pathlib.Path(__file__).parent)
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
    kernels = results["kernels"]  # Triton kernels per shard (interpret mode) against one device's XLA attention
    assert kernels["score_max_abs_diff"] <= 1e-4 and kernels["generate_equal"], kernels


def test_a_mesh_needs_the_data_and_model_axes():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jcascade as jc
    import tiny

    with pytest.raises(ValueError, match=r"axes \('data', 'model'\)"):
        jc.models.shard(tiny.model(97), Mesh(np.array(jax.devices()[:1]), ("x",)))


def main():
    import re
    import tempfile
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jcascade as jc
    import tiny

    assert len(jax.devices()) == 8
    model = tiny.model(96, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 96, (8, 40)), jnp.int32)
    lengths = jnp.asarray([40, 31, 40, 12, 25, 40, 38, 20], jnp.int32)
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
    # the Pallas kernels (Triton, interpret mode) run per shard under shard_map
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sharded, policy = jc.models.shard(model, mesh), policies[0]
    score, generated = one_device[type(policy).__name__]
    kernels = dict(score_max_abs_diff=float(jnp.max(jnp.abs(
                       score - jc.score(sharded, tokens, policy, lengths=lengths, implementation="triton")))),
                   generate_equal=bool((generated == jc.generate(sharded, tokens[:, :24], policy, max_new_tokens=6,
                                                                  lengths=jnp.minimum(lengths, 24),
                                                                  implementation="triton")).all()))
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jc.models.shard(tiny.model(97, num_heads=6, num_kv_heads=3), Mesh(np.array(jax.devices()[:2]).reshape(1, 2),
                                                                         ("data", "model")))
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    snippet = readme.split("## Multi-device", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # as written
    print(json.dumps(dict(cases=cases, cache_all_gathers=gathers, warning=" ".join(str(w.message) for w in caught),
                          readme_out=np.asarray(namespace["out"]).tolist(), loaded_as_sharded=loaded_as_sharded,
                          kernels=kernels)))


if __name__ == "__main__":
    main()
