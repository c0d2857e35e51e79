"""2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives), one (2, 4) mesh: the model
restored from a converted checkpoint straight into its shards, score and greedy generate as on one device.
The processes are this file run as a script (the device count is fixed when jax starts; jcascade, and so jax's
backends, load only after jax.distributed.initialize)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

TINY = dict(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4)  # 96 tokens


def inputs():
    """8 ragged rows of 40 tokens: the same host values in every process."""
    tokens = np.random.default_rng(0).integers(0, 96, (8, 40)).astype(np.int32)
    return tokens, np.array([40, 31, 40, 12, 25, 40, 38, 20], np.int32)


def policies():
    """One policy: the policies on a mesh are test_sharding.py's; here, the processes."""
    import jcascade as jc

    return [jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8)]


def score_and_generate(model, policy, tokens, lengths):
    import jcascade as jc

    score = jc.score(model, tokens, policy, lengths=lengths, prefix=24 if policy.needs_prompt else None)
    generated = jc.generate(model, tokens[:, :24], policy, max_new_tokens=6, lengths=np.minimum(lengths, 24))
    return score, generated


@pytest.mark.slow
def test_two_processes_give_the_one_process_result(tmp_path):
    import jax.numpy as jnp
    import tiny
    from jax.sharding import PartitionSpec

    import jcascade as jc

    model = tiny.model(96, **TINY)
    jc.save_converted(model, tmp_path / "model")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(i), str(port), str(tmp_path / "model")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=pathlib.Path(__file__).parent,
        )
        for i in range(2)
    ]
    outputs = [w.communicate(timeout=600) for w in workers]
    for w, (_, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [r["process"] for r in results] == [0, 1] and all(r["devices"] == [8, 4] for r in results)
    tokens, lengths = inputs()
    for policy in policies():
        name = type(policy).__name__
        score, generated = score_and_generate(model, policy, tokens, lengths)
        for r in results:  # each process gathered the whole result
            assert np.max(np.abs(np.asarray(score) - np.array(r[name]["score"]))) <= 1e-4, name
            assert (np.asarray(generated) == np.array(r[name]["generate"])).all(), name
            assert r[name]["cache_spec"] == str(PartitionSpec(None, "data", "model", None, None))
        assert not jnp.isnan(score).any()


def worker(process: int, port: int, checkpoint: str):
    """One of 2 processes: docs/multi-device.md's multi-host recipe on a (2, 4) mesh over both processes' devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    import jcascade as jc

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    model = jc.load_pretrained(checkpoint, mesh=mesh)
    tokens, lengths = inputs()  # the same host values on every process
    results = dict(process=jax.process_index(), devices=[len(jax.devices()), len(jax.local_devices())])
    for policy in policies():
        score, generated = score_and_generate(model, policy, tokens, lengths)
        results[type(policy).__name__] = dict(
            score=np.asarray(multihost_utils.process_allgather(score, tiled=True)).tolist(),
            generate=np.asarray(multihost_utils.process_allgather(generated, tiled=True)).tolist(),
            cache_spec=str(model.init_cache(policy, 8, max_tokens=64).cache.k.data.sharding.spec),
        )
    print(json.dumps(results))


if __name__ == "__main__":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
