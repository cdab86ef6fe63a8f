"""On-policy distillation (trainers/distill.py): the per-token advantage against its formula
on a hand-made batch, the loss's gradient against one computed by hand, the teacher's
tokenizer refused where it differs, the teacher in two gloo ranks under FSDP2 against the
single process, and a teacher behind a real ``agentgym serve`` on loopback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from agentgym.config import build_config
from agentgym.core.types import Trajectory
from agentgym.models.tiny import build_tiny
from agentgym.models.zoo import load_model, load_tokenizer
from agentgym.trainers.batch import collate
from agentgym.trainers.distill import (Teacher, check_tokenizers, distill_term, teacher_logprobs,
                                       tokenizer_difference)
from agentgym.trainers.phases import advantages, make_loss_fn


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """A teacher of the student's (``tiny``'s) tokenizer and another shape: wider, deeper,
    other weights."""
    return build_tiny(tmp_path_factory.mktemp("teacher") / "m", hidden_size=96, num_layers=3,
                      seed=7)


def _trajs(rewards=(1.0, 0.0, 1.0)):
    """Three two-turn episodes of one prompt: prompt, a turn, an observation, a turn."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, r in enumerate(rewards):
        t = Trajectory(uid="q", sample_index=i, reward=r, step_rewards=[0.0, r])
        rand = lambda n: torch.randint(5, 300, (n,), generator=g).tolist()  # noqa: E731
        t.append("prompt", rand(4), 0)
        t.append("generated", rand(3 + i), 0, logprobs=(-torch.rand(3 + i, generator=g)).tolist())
        t.append("observation", rand(2), 0)
        t.append("generated", rand(2), 1, logprobs=(-torch.rand(2, generator=g)).tolist())
        out.append(t)
    return out


def _batch(tok, rewards=(1.0, 0.0, 1.0)):
    b = collate(_trajs(rewards), tok.pad_token_id)
    g = torch.Generator().manual_seed(1)
    b.teacher_logp = torch.where(b.loss_mask > 0, -3 * torch.rand(b.loss_mask.shape, generator=g),
                                 0.0)
    b.teacher_mask = b.loss_mask.clone()
    return b


@pytest.mark.parametrize("algo,coef", [("grpo", 0.5), ("opd", 1.0)])
def test_the_advantage_is_the_formula_token_by_token(tiny_tokenizer, algo, coef):
    cfg = build_config({"algo": algo, "algo.distill_coef": coef, "trainer.teacher": "tiny"})
    b = _batch(tiny_tokenizer)
    adv, _ = advantages(cfg, b, b.token_rewards)
    rewards = torch.tensor([1.0, 0.0, 1.0])
    env = (rewards - rewards.mean()) / (rewards.std() + 1e-6) if algo == "grpo" else 0 * rewards
    for i in range(len(b)):
        for t in range(b.input_ids.shape[1]):
            if b.loss_mask[i, t] > 0:
                want = float(env[i]) + coef * float(b.teacher_logp[i, t] - b.rollout_logp[i, t])
                assert float(adv[i, t]) == pytest.approx(want, abs=1e-6), (i, t)
            else:  # prompt, observation, padding
                assert float(adv[i, t]) == 0.0, (i, t)
    assert (b.loss_mask == 0).sum() > 0 and (b.rollout_logp != 0).sum() > 0


def test_a_group_of_one_gets_the_whole_term(tiny_tokenizer):
    """Not group-normalised: with one sample GRPO's part is 0 and the term is all."""
    cfg = build_config({"algo.distill_coef": 1.0, "trainer.teacher": "tiny", "rollout.n": 2})
    b = collate(_trajs((1.0,)), tiny_tokenizer.pad_token_id)
    b.teacher_logp = torch.where(b.loss_mask > 0, torch.full(b.loss_mask.shape, -0.25), 0.0)
    b.teacher_mask = b.loss_mask.clone()
    adv, _ = advantages(cfg, b, b.token_rewards)
    want = torch.where(b.loss_mask > 0, -0.25 - b.rollout_logp, 0.0)
    torch.testing.assert_close(adv, want)


def test_the_discount_sums_the_following_sampled_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.float32)  # an observation at 3
    teacher = torch.tensor([[0, -1.0, -2.0, -9.0, -3.0, -9.0]])
    student = torch.tensor([[0, -0.5, -0.5, -9.0, -0.5, -9.0]])
    d = [-0.5, -1.5, -2.5]  # the sampled tokens' own terms
    g = 0.5
    want = [0, d[0] + g * d[1] + g * g * d[2], d[1] + g * d[2], 0, d[2], 0]
    got = distill_term(teacher, student, mask, 1.0, discount=g)
    torch.testing.assert_close(got, torch.tensor([want]))
    own = distill_term(teacher, student, mask, 2.0)
    torch.testing.assert_close(own, torch.tensor([[0, 2 * d[0], 2 * d[1], 0, 2 * d[2], 0]]))


def test_the_losss_gradient_is_the_one_computed_by_hand(tiny_path, tiny_tokenizer):
    """On-policy (old = current logprobs, ratio 1), PPO's clipped loss at token-mean has the
    gradient of ``-sum_t adv_t log p(y_t) / N``: computed here with autograd on the model's
    own logprobs and the formula's advantages."""
    from agentgym.trainers.backends.base import token_logprobs
    cfg = build_config({"algo": "opd", "trainer.teacher": "tiny"})
    b = _batch(tiny_tokenizer)
    advantages(cfg, b, b.token_rewards)
    model = load_model(tiny_path)
    n = float(b.loss_mask.sum())
    loss, _ = make_loss_fn(cfg, 1.0, n, len(b), 64)(model, b)
    got = torch.autograd.grad(loss, [p for p in model.parameters()])
    logp, _ = token_logprobs(model, b, torch.device("cpu"), 1.0)
    adv = torch.where(b.loss_mask > 0, b.teacher_logp - b.rollout_logp, 0.0)
    by_hand = -(adv * logp).sum() / n
    want = torch.autograd.grad(by_hand, [p for p in model.parameters()])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-5)
    assert max(float(w.abs().max()) for w in want) > 1e-4


def test_a_teacher_of_another_tokenizer_is_refused_by_name(tiny_path, tiny_tokenizer, tmp_path):
    other = build_tiny(tmp_path / "other", vocab_size=512)
    with pytest.raises(ValueError, match="runs/other.*tiny.*vocabulary has 1024 tokens in "
                                         "the student's, 512 in the teacher's"):
        check_tokenizers(tiny_tokenizer, load_tokenizer(other), "tiny", "runs/other")
    special = tmp_path / "special"  # one more special token, the vocabulary otherwise as is
    shutil.copytree(tiny_path, special)
    tok = load_tokenizer(special)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert "vocabulary has 1024 tokens in the student's, 1025" in tokenizer_difference(
        tiny_tokenizer, tok)
    chat = tmp_path / "chat"  # the same vocabulary, another chat template
    shutil.copytree(tiny_path, chat)
    conf = json.loads((chat / "tokenizer_config.json").read_text())
    conf["chat_template"] = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n"
                             "{% endfor %}")
    (chat / "tokenizer_config.json").write_text(json.dumps(conf))
    (chat / "chat_template.jinja").unlink(missing_ok=True)
    diff = tokenizer_difference(tiny_tokenizer, load_tokenizer(chat))
    assert diff.startswith("the chat template renders the same conversation differently "
                           "from token 0"), diff
    assert tokenizer_difference(tiny_tokenizer, load_tokenizer(tiny_path)) is None


def test_the_config_resolves_and_refuses_what_distils_nothing(teacher_path):
    cfg = build_config({"trainer.teacher": str(teacher_path), "algo": "opd"})
    assert (cfg.algo.advantage, cfg.algo.distill_coef) == ("none", 1.0)
    mixed = build_config({"env": "search,code", "trainer.teacher": ["", str(teacher_path)],
                          "algo.distill_coef": 0.5})
    assert mixed.per_env["trainer.teacher"] == ["", str(teacher_path)]
    from agentgym.trainers.distill import teacher_names
    assert teacher_names(mixed) == ["", str(teacher_path)]
    from agentgym.trainers.phases import check_algo
    check_algo(cfg)
    with pytest.raises(ValueError, match="trainer.teacher is empty"):
        check_algo(build_config({"algo": "opd"}))
    with pytest.raises(ValueError, match="algo.distill_coef=0 would leave it unused"):
        check_algo(build_config({"trainer.teacher": str(teacher_path)}))
    with pytest.raises(ValueError, match="gives 1 values for the 2 env"):
        build_config({"env": "search,code", "trainer.teacher": [str(teacher_path)],
                      "algo.distill_coef": 0.5})


def test_each_env_is_scored_by_its_own_teacher(tiny_path, tiny_tokenizer, teacher_path):
    """A mixed run: rows of env a by one teacher, of b by another, of c by none."""
    b = collate(_trajs(), tiny_tokenizer.pad_token_id)
    one = Teacher("one", model=load_model(tiny_path), micro_batch_tokens=64)
    two = Teacher("two", model=load_model(teacher_path), micro_batch_tokens=64)
    lp, scored = teacher_logprobs({"a": one, "b": two}, b, ["a", "b", "c"], 1.0)
    whole_one, whole_two = one.logprobs(b, 1.0), two.logprobs(b, 1.0)
    torch.testing.assert_close(lp[0], whole_one[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[1], whole_two[1], atol=1e-5, rtol=0)
    assert float(lp[2].abs().sum()) == 0 and float(scored[2].sum()) == 0
    torch.testing.assert_close(scored[:2], b.loss_mask[:2])
    assert float((whole_one[1] - whole_two[1]).abs().max()) > 0.01  # two different teachers


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed", "ray"])
def test_the_teacher_in_fsdp_ranks_gives_the_single_process_loss_and_gradients(
        tiny_path, tiny_tokenizer, teacher_path, kind):
    """Two gloo ranks (FSDP2, DeepSpeed ZeRO-2, and FSDP2 ranks as actors of a real local
    Ray) hold the teacher as they hold the reference (FSDP shards it, ZeRO keeps a whole
    copy): its logprobs, the step's loss and the weights after it match the single
    process's."""
    from agentgym.trainers.backends.base import ModelSpec
    from agentgym.trainers.backends.distributed import DistributedBackend
    from agentgym.trainers.backends.ranks import OptimSpec
    from agentgym.trainers.backends.single import SingleBackend
    cfg = build_config({"algo": "opd", "trainer.teacher": str(teacher_path)})
    spec = ModelSpec(str(teacher_path))

    def step(backend, teacher: Teacher):
        b = collate(_trajs(), tiny_tokenizer.pad_token_id)
        b.teacher_logp, b.teacher_mask = teacher_logprobs({"e": teacher}, b, ["e"] * len(b), 1.0)
        advantages(cfg, b, b.token_rewards)
        n = float(b.loss_mask.sum())
        res = backend.train_step(backend.split(b), make_loss_fn(cfg, 1.0, n, len(b), 64))
        return b.teacher_logp, res, backend.state_dict()

    single = SingleBackend(ModelSpec(str(tiny_path)).load(), lr=1e-2, micro_batch_tokens=64)
    s_lp, s_res, s_w = step(single, Teacher("t", model=spec.load(), micro_batch_tokens=64))
    cluster = ranks = None
    if kind == "ray":
        pytest.importorskip("ray")
        from agentgym.trainers.ray_cluster import RayCluster, RayRanks
        # two bundles of half a CPU each: both ranks fit on this 2-core machine
        cluster = RayCluster(build_config({"ray.address": "local", "ray.cpus": 0.5,
                                           "backend": "fsdp", "trainer.nprocs": 2}))
        ranks = RayRanks(cluster, 2, "fsdp", ModelSpec(str(tiny_path)), OptimSpec(lr=1e-2),
                         "policy")
    backend = DistributedBackend("fsdp" if kind == "ray" else kind, ModelSpec(str(tiny_path)),
                                 OptimSpec(lr=1e-2), 2, 64, ranks)
    try:
        d_lp, d_res, d_w = step(backend, Teacher("t", backend=backend, spec=spec))
    finally:
        backend.close()
        if cluster is not None:
            cluster.close()
    torch.testing.assert_close(d_lp, s_lp, atol=1e-4, rtol=0)
    assert d_res["loss"] == pytest.approx(s_res["loss"], rel=1e-6)
    assert d_res["grad_norm"] == pytest.approx(s_res["grad_norm"], rel=1e-5)
    for k in s_w:
        torch.testing.assert_close(d_w[k], s_w[k], atol=1e-4, rtol=0)


def test_a_teacher_behind_agentgym_serve_scores_as_in_process(teacher_path, tiny_tokenizer):
    """``agentgym serve`` on loopback answers SGLang's prompt-logprob request; the endpoint
    teacher's logprobs are the in-process teacher's, at the loss's temperature."""
    from agentgym.rollout.engines.launcher import launch_serve
    from agentgym.trainers.distill import teachers
    b = collate(_trajs(), tiny_tokenizer.pad_token_id)
    local = Teacher("t", model=load_model(teacher_path), micro_batch_tokens=64)
    want = local.logprobs(b, 0.7)
    with launch_serve(str(teacher_path)) as server:
        cfg = build_config({"algo": "opd", "trainer.teacher": server.url, "model": "tiny"})
        by_env = teachers(cfg, tiny_tokenizer, backend=None)
        got, _ = teacher_logprobs(by_env, b, [cfg.env] * len(b), 0.7)
        import httpx
        bad = httpx.post(server.url + "/generate", json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 3}, timeout=60)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert bad.status_code == 400 and "logprob_start_len=3" in bad.text, bad.text


def _toy(tmp_path, **keys):
    from agentgym.data.rows import write_jsonl
    from toy_envs import letter_rows
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(64))
    return {"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
            "trainer.prompts_per_step": 4, "rollout.n": 2, "rollout.max_tokens_per_turn": 8,
            "trainer.eval_limit": 0, "trainer.save_every": 100, "trainer.cold_start": "off",
            "trainer.seed": 0, **keys}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_distils_in_both_modes(tmp_path, teacher_path, mode):
    from agentgym.trainers.loop import train
    run = train(build_config(_toy(tmp_path, **{
        "algo": "opd", "trainer.teacher": str(teacher_path), "trainer.total_steps": 2,
        "trainer.mode": mode, "run_dir": str(tmp_path / mode)})))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 2
    for r in steps:  # the student's and the teacher's log-probs of the sampled tokens
        assert r["distill/reverse_kl"] == pytest.approx(
            r["distill/student_logp"] - r["distill/teacher_logp"], abs=1e-5)
        assert r["distill/teacher_logp"] < 0 and r["rollout/distill_adv_abs"] > 0


@pytest.fixture(scope="module")
def letter_teacher(tmp_path_factory):
    """A teacher that solves the toy Letter env: ``tiny`` after 24 GRPO steps of it (its
    sampled reward 0.11 → 0.97, measured), as a run folder (its newest checkpoint)."""
    from agentgym.trainers.loop import train
    tmp = tmp_path_factory.mktemp("letter")
    return train(build_config(_toy(tmp, **{"trainer.total_steps": 24, "trainer.seed": 1,
                                           "rollout.n": 8, "trainer.lr": 1e-2,
                                           "run_dir": str(tmp / "teacher")})))


def test_distillation_alone_moves_the_student_towards_the_teacher(tmp_path, letter_teacher):
    """algo=opd from a fresh ``tiny``: the env's reward plays no part in the gradient, yet
    the student's samples earn it more as their reverse KL from the teacher falls
    (measured over 20 steps: reward 0.10 → 0.33 and KL 7.1 → 4.7, first and last three)."""
    from agentgym.trainers.loop import train
    run = train(build_config(_toy(tmp_path, **{
        "algo": "opd", "trainer.teacher": str(letter_teacher), "trainer.total_steps": 20,
        "rollout.n": 8, "trainer.lr": 1e-2, "run_dir": str(tmp_path / "opd")})))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    reward = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    assert len(kl) == len(reward) == 20
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(kl[-3:]) < mean(kl[:3]) - 1.5, kl
    assert mean(reward[-3:]) > mean(reward[:3]) + 0.1, reward
