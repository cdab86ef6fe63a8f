"""The engine's model runner and KV pool (agentgym.rollout.engines.model_runner, kv_pool):
its forward equals the model's own, padded prefill rows do not see each other, a pushed
weight is seen by the next step (on the CPU its packed copy is made again), and on a GPU
the captured step equals the eager one."""

import copy

import pytest
import torch

from agentgym.rollout.engines.kv_pool import KVPool
from agentgym.rollout.engines.model_runner import ModelRunner, column_bucket, why_not_supported
from agentgym.rollout.engines.packed import why_not_packed

SHAPES = ["smollm2-135m", "qwen2.5-0.5b"]  # the Llama and Qwen2 families (biases, GQA)


#: a small Qwen3 (its queries and keys RMS-normed per head before the rotary embedding)
QWEN3 = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "vocab_size": 1000, "max_position_embeddings": 512, "tie_word_embeddings": True}


def shrunk(shape: str, device: str = "cpu", layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentgym.models.shapes import shape_config
    config = dict(QWEN3) if shape == "qwen3" else {
        k: v for k, v in shape_config(shape).items()
        if k not in ("_name_or_path", "transformers_version", "torch_dtype")}
    config.update(num_hidden_layers=layers, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
                                             attn_implementation="sdpa")
    return model.to(device).eval()


def pool_for(model, slots=4, capacity=256, growable=True) -> KVPool:
    c = model.config
    return KVPool(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                  next(model.parameters()).dtype, next(model.parameters()).device, slots, capacity,
                  growable)


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device)).logits[0, -1].float()


def prefill(runner: ModelRunner, pool: KVPool, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt in one padded batch into slots 0.. of ``pool``."""
    width = max(len(p) for p in prompts)
    n, dev = len(prompts), runner.device
    ids = torch.zeros((n, width), dtype=torch.long, device=dev)
    valid = torch.zeros((n, width), dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        valid[i, :len(p)] = True
        pool.add(i, len(p))
    positions = torch.arange(width, device=dev)[None].expand(n, -1)
    last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
    return runner.prefill(ids, positions, valid, torch.arange(n, device=dev), last, width, pool)


@pytest.mark.parametrize("shape", [*SHAPES, "qwen3"])
def test_forward_over_the_pool_equals_the_models_own(shape):
    model = shrunk(shape)
    assert why_not_supported(model) is None
    pool = pool_for(model)
    runner = ModelRunner(model, pool)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 19, 3)]
    with torch.inference_mode():
        logits = prefill(runner, pool, prompts)
        for i, p in enumerate(prompts):  # padded rows never see each other's tokens
            torch.testing.assert_close(logits[i].float(), reference(model, p), atol=2e-5, rtol=0)
        histories = [list(p) for p in prompts]
        for _ in range(3):
            nxt = logits.argmax(-1)
            for h, t in zip(histories, nxt.tolist()):
                h.append(t)
            positions = torch.tensor([len(h) - 1 for h in histories])
            logits = runner.decode(nxt, positions, max(len(h) for h in histories))
            for i, h in enumerate(histories):
                torch.testing.assert_close(logits[i].float(), reference(model, h), atol=2e-5,
                                           rtol=0)


def test_a_row_that_leaves_moves_the_last_row_and_the_pool_grows_with_its_contents():
    model = shrunk("smollm2-135m")
    pool = pool_for(model, slots=1, capacity=8)
    runner = ModelRunner(model, pool)
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [31, 32]]
    with torch.inference_mode():
        prefill(runner, pool, prompts)  # grows: 3 slots, 10 columns
        assert pool.slots >= 3 and pool.capacity >= 10 and pool.grown >= 1
        kept = pool.kv_of(2, 0, 2).clone()
        assert pool.remove(0) == 2  # the last row moved into slot 0
        assert pool.rows == [2, 1] and pool.length == [2, 10]
        torch.testing.assert_close(pool.kv_of(0, 0, 2), kept)
        # decoding the moved row continues its own sequence
        logits = runner.decode(torch.tensor([40, 41]), torch.tensor([2, 10]), 11)
    torch.testing.assert_close(logits[0].float(), reference(model, [31, 32, 40]), atol=2e-5,
                               rtol=0)
    torch.testing.assert_close(logits[1].float(), reference(model, prompts[1] + [41]),
                               atol=2e-5, rtol=0)


def test_a_pool_growing_its_columns_sizes_its_slots_to_the_live_rows_and_keeps_them():
    """After 40 short rows, 6 long ones: the columns double and the slots shrink to what
    is live (8), not the 64 the pool once had; the live rows keep their keys/values."""
    model = shrunk("smollm2-135m")
    pool = pool_for(model, slots=1, capacity=8)
    for owner in range(40):
        pool.add(owner, 4)
    assert (pool.slots, pool.capacity) == (64, 8)  # slots doubled, columns as they were
    while pool.live > 6:
        pool.remove(pool.live - 1)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((2, 2, pool.kv_heads, 4, pool.head_dim), generator=g)
    pool.put(5, kv)
    pool.ensure(pool.live, 300)
    assert (pool.slots, pool.capacity) == (8, 512)
    torch.testing.assert_close(pool.kv_of(5, 0, 4), kv, atol=0, rtol=0)
    pool.ensure(20, 4)  # more rows: the slots double, the columns stay
    assert (pool.slots, pool.capacity) == (32, 512)
    torch.testing.assert_close(pool.kv_of(5, 0, 4), kv, atol=0, rtol=0)


def test_a_fixed_pool_refuses_a_request_it_cannot_hold_by_name():
    model = shrunk("smollm2-135m")
    pool = pool_for(model, slots=2, capacity=16, growable=False)
    with pytest.raises(ValueError, match="engine.max_len"):
        pool.ensure(2, 17)


def test_column_buckets_grow_by_about_half():
    seen = [column_bucket(n) for n in (1, 128, 129, 193, 257, 1000, 5000)]
    assert seen == [128, 128, 192, 256, 384, 1024, 6144]


def decode_run(runner: ModelRunner, pool: KVPool, steps: int = 3) -> torch.Tensor:
    """Logits of a padded prefill of three prompts and ``steps`` decode steps of fixed
    tokens (the same inputs whatever the logits: two runs compare step by step)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 19, 3)]
    lengths, out = [len(p) for p in prompts], []
    with torch.inference_mode():
        logits = prefill(runner, pool, prompts)
        for step in range(steps):
            out.append(logits.float().clone())
            ids = torch.tensor([11 + step, 12 + step, 13 + step])
            logits = runner.decode(ids, torch.tensor(lengths), max(lengths) + 1)
            lengths = [n + 1 for n in lengths]
    return torch.stack(out + [logits.float()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_on_the_cpu_give_the_logits_of_torchs_own_linear(dtype):
    """engine.packed_weights: the projections and the head over oneDNN-blocked copies,
    q/k/v and gate/up stacked (Qwen2's shape: the q/k/v biases go with them), give torch's
    linear's logits."""
    why = why_not_packed(dtype)
    if why:
        pytest.skip(why)
    model = shrunk("qwen2.5-0.5b").to(dtype)
    got = {}
    for packed in (False, True):
        runner = ModelRunner(model, pool := pool_for(model), packed=packed)
        got[packed] = decode_run(runner, pool)
    assert runner.packed is not None and len(runner.packed.linears) == 2 * 7 + 1
    assert runner.packed.packs == len(runner.packed.linears)  # packed once, not every step
    tol = 2e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got[True], got[False], atol=tol, rtol=0)


def test_packed_copies_follow_a_replaced_storage_and_a_written_bias():
    """A group is packed again when a weight moves to new storage (``.data = ...``, which
    leaves the version counter) or a bias is written in place; the others are kept."""
    why = why_not_packed(torch.float32)
    if why:
        pytest.skip(why)
    model = shrunk("qwen2.5-0.5b")
    packed = ModelRunner(model, pool_for(model)).packed
    assert packed.refresh() == len(packed.linears) and packed.refresh() == 0
    attn = model.model.layers[0].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    attn.q_proj.weight.data = attn.q_proj.weight.data * 2
    assert packed.refresh() == 3
    with torch.no_grad():
        attn.v_proj.bias.add_(1.0)
    assert packed.refresh() == 3
    x = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for got, m in zip(packed(group, x), group):
            torch.testing.assert_close(got, m(x), atol=1e-5, rtol=0)


def test_small_groups_run_over_a_plain_stacked_copy_that_follows_the_weights():
    """Below ``BLOCKED_MIN`` weight elements (``tiny``: width 64) oneDNN's call costs more
    than it saves: q/k/v and gate/up run as one ``F.linear`` each over a plain stacked
    copy, o_proj and the head their own. The logits are torch's linear's, before and after
    a weight push (the copy is made again, once)."""
    from transformers import AutoModelForCausalLM

    from agentgym.models.zoo import resolve_model
    if why_not_packed(torch.float32):
        pytest.skip(why_not_packed(torch.float32))
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    runner = ModelRunner(model.eval(), pool := pool_for(model))
    assert runner.packed.blocked == [] and len(runner.packed.linears) == 2 * 5
    got = decode_run(runner, pool)
    torch.testing.assert_close(got, decode_run(ModelRunner(model, pool := pool_for(model),
                                                           packed=False), pool),
                               atol=1e-5, rtol=0)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.load_state_dict(new.state_dict())
    runner.pool.clear()  # the old weights' keys/values
    after = decode_run(runner, runner.pool)
    assert not torch.allclose(after, got, atol=1e-3)
    torch.testing.assert_close(after, decode_run(ModelRunner(new, pool := pool_for(new),
                                                             packed=False), pool),
                               atol=1e-5, rtol=0)
    assert runner.packed.packs == 2 * len(runner.packed.linears)


def test_unpacked_when_the_key_says_so_or_the_layer_is_not_a_plain_linear():
    model = shrunk("smollm2-135m")
    plain = ModelRunner(model, pool := pool_for(model), packed=False)
    assert plain.packed is None
    want = decode_run(plain, pool)
    wrapped = torch.nn.Sequential(model.model.layers[0].self_attn.q_proj)
    model.model.layers[0].self_attn.q_proj = wrapped  # as an adapter wraps a layer
    runner = ModelRunner(model, pool := pool_for(model))
    if runner.packed is None:
        pytest.skip(why_not_packed(torch.float32))
    assert wrapped not in runner.packed.linears and wrapped[0] not in runner.packed.linears
    # the wrapped layer's group (q, k, v of layer 0) runs its own linears
    assert len(runner.packed.linears) == 2 * 7 + 1 - 3
    torch.testing.assert_close(decode_run(runner, pool), want, atol=2e-5, rtol=0)


def devices() -> list:
    marks = [pytest.param("cpu"), pytest.param("standin")]
    marks.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return marks


@pytest.mark.parametrize("device", devices())
def test_weights_pushed_between_steps_change_the_next_steps_logits(device):
    """After load_state_dict (what HFEngine.update_weights does) the next decode step is
    the new weights' own: on a GPU (and the CPU's graph stand-in) its captured graph kept
    the parameters' storage."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    standin, device = device == "standin", "cpu" if device == "standin" else device
    model = shrunk("smollm2-135m", device)
    captured = device == "cuda" or standin
    pool = pool_for(model, slots=8, capacity=64, growable=not captured)
    runner = ModelRunner(model, pool, graphs=True, standin=standin)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = [5, 6, 7, 8]
    with torch.inference_mode():
        prefill(runner, pool, [prompt])
        t = torch.tensor([9], device=device)
        pos = torch.tensor([4], device=device)
        before = runner.decode(t, pos, 5).float().clone()
        model.load_state_dict(new.state_dict())
        pool.clear()  # the old weights' keys/values are stale: prefill again
        prefill(runner, pool, [prompt])
        after = runner.decode(t, pos, 5).float().clone()
    assert not torch.allclose(before, after, atol=1e-3)
    torch.testing.assert_close(after[0], reference(new, prompt + [9]), atol=1e-4, rtol=0)
    if runner.packed is not None:  # the CPU: every packed copy was made again, once
        assert runner.packed.packs == 2 * len(runner.packed.linears)
    if captured:
        assert runner.stats["graph_replays"] == 2 and runner.stats["graphs"] == 1


@pytest.mark.gpu
def test_the_captured_decode_step_equals_the_eager_step():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    model = shrunk("qwen2.5-0.5b", "cuda")
    outs = []
    for graphs in (False, True):
        pool = pool_for(model, slots=16, capacity=128, growable=False)
        runner = ModelRunner(model, pool, graphs=graphs)
        prompts = [[5 + i, 6, 7 + i, 8, 9][:3 + i % 3] for i in range(5)]
        got = []
        with torch.inference_mode():
            logits = prefill(runner, pool, prompts)
            lengths = [len(p) for p in prompts]
            for _ in range(4):
                nxt = logits.argmax(-1)
                logits = runner.decode(nxt, torch.tensor(lengths, device="cuda"),
                                       max(lengths) + 1).float().clone()
                lengths = [n + 1 for n in lengths]
                got.append(logits)
        outs.append(torch.stack(got))
        if graphs:
            assert runner.stats["graph_replays"] == 4
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
