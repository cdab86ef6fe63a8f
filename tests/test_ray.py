"""Ray placement on a real local cluster of two nodes (a head and a worker node, each
its own raylet on loopback, 1 CPU each): ``agentgym train … ray.address=<cluster>
placement=split`` puts the train rank and the rollout worker on different nodes,
``placement=colocated`` in one bundle; both train like the same run without Ray (same
samples, same losses) and sync weights to the worker."""

from __future__ import annotations

import json
import os

import pytest

from agentgym.config import build_config
from agentgym.trainers.loop import train

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster
    # as trainers.ray_cluster does for ray.address=local: actors at normal priority (Ray's
    # default niceness 15 starves them when anything else keeps the cores busy)
    niceness = os.environ.get("RAY_worker_niceness")
    os.environ["RAY_worker_niceness"] = "0"
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    finally:
        if niceness is None:
            os.environ.pop("RAY_worker_niceness")
        else:
            os.environ["RAY_worker_niceness"] = niceness
    yield cluster
    cluster.shutdown()


def _args(tmp_path, name, retriever_url) -> list[str]:
    # an entropy bonus keeps every update running: with the untrained model's all-zero
    # rewards it would be skipped, and the losses compared below would not exist
    return ["env=search", "model=tiny", "trainer.total_steps=2", "trainer.prompts_per_step=2",
            "n=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=256",
            "trainer.eval_limit=0", "trainer.lr=1e-3", "backend=fsdp", "trainer.nprocs=1",
            "algo.entropy_coef=0.001", "trainer.cold_start=off",
            f"retriever.url={retriever_url}", f"run_dir={tmp_path / name}"]


def _cfg(tmp_path, name, retriever_url):
    from agentgym.core.overrides import parse_overrides
    return build_config(parse_overrides(_args(tmp_path, name, retriever_url)))


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def without_ray(tmp_path_factory, retriever_url):
    return _metrics(train(_cfg(tmp_path_factory.mktemp("local"), "run", retriever_url)))


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_train_across_a_two_node_ray_cluster(tmp_path, two_nodes, retriever_url,
                                            without_ray, placement):
    from transformers import AutoModelForCausalLM

    from agentgym.cli import main
    assert main(["train", *_args(tmp_path, placement, retriever_url),
                 f"ray.address={two_nodes.address}", f"placement={placement}"]) == 0
    run = tmp_path / placement
    where = json.loads((run / "placement.json").read_text())
    (rank_node,), (worker_node,) = where["policy_ranks"], where["rollout_workers"]
    if placement == "split":
        assert rank_node != worker_node  # one bundle per role: a node each
    else:
        assert rank_node == worker_node  # the worker shares the rank's bundle
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["rollout/policy_version"] == 1.0  # the worker got the step-1 weights
    for a, b in zip(rows, without_ray):  # where the actors ran changes nothing
        for key in ("rollout/reward", "rollout/response_length", "train/pg_loss",
                    "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_2") is not None


def test_async_training_across_two_nodes(tmp_path, two_nodes, retriever_url, without_ray):
    """trainer.mode=async with the rollout worker on the other node: at max_staleness=0 it
    trains on the same samples as the synchronous run without Ray; at max_staleness=1,
    over 4 steps (unbounded, samples could be 3 versions old), the bound holds on every
    step and the worker did roll out ahead of training."""
    from agentgym.cli import main
    for staleness, steps in ((0, 2), (1, 4)):
        name = f"async{staleness}"
        assert main(["train", *_args(tmp_path, name, retriever_url),
                     f"ray.address={two_nodes.address}", "placement=split",
                     "trainer.mode=async", f"trainer.max_staleness={staleness}",
                     f"trainer.total_steps={steps}"]) == 0
        rows = _metrics(tmp_path / name)
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        assert all(r["async/staleness_max"] <= staleness for r in rows)
        if staleness == 1:
            assert max(r["async/staleness_max"] for r in rows) == 1.0
        if staleness == 0:
            for a, b in zip(rows, without_ray):
                for key in ("rollout/reward", "rollout/response_length", "train/pg_loss",
                            "train/grad_norm"):
                    assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
