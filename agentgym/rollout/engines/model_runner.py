"""The model's forward over the KV pool, and its decode step captured as CUDA graphs.

:class:`ModelRunner` runs a decoder of the Llama family (Llama, SmolLM2, Qwen2/2.5,
Qwen3, Mistral without a sliding window) with the model's own parameters (embedding,
norms, projections, MLPs, head: the same storage, so a weight update is seen at once; an
RMSNorm runs as one fused op over its weight, the rotary embedding from a table of the
model's own) and its own attention over :class:`~agentgym.rollout.engines.kv_pool.KVPool`:
each new position's keys and values are written to its row's slot at the column of its
position, and the attention reads the slot's leading columns with the mask
``column <= position``. Grouped-query heads are folded into the query length (a
key/value head's query heads attend as one sequence), so no key or value is repeated.

On the CPU the projections and the head run over oneDNN-blocked copies of their weights
(:mod:`~agentgym.rollout.engines.packed`; ``engine.packed_weights``), q/k/v and gate/up
stacked into one product each (a plain stacked copy where the weights are too small for
oneDNN to pay); the copies are made again before the first step after a weight changes.

On a GPU the decode step is captured as a CUDA graph per (batch bucket, column bucket):
the step's inputs are copied into static tensors, the graph replays, the logits are read
from a static buffer (nano-vllm's ``model_runner``; the pool, the rotary table and the
parameters keep their addresses). Batches are padded to the bucket: padded rows write
into free slots at column 0 and are never read. Every bucket is captured by
:meth:`ModelRunner.capture_all` when the engine starts, while the pool is empty, so no
capture runs while rows are live, and none costs time inside a rollout; a bucket missed
there is captured on first use with the step's real inputs already in the static tensors
(its warm-ups then write what the step itself writes). The rotary table is built once for
the pool's columns and never replaced while graphs read it. ``graphs=False`` (and the
CPU) runs the same step eagerly.

``standin=True`` runs the GPU's path on the CPU (tests; ``make gpu-check``'s
``--cpu-smoke``): graphs through :class:`~agentgym.core.recorded_graph.RecordedGraph`,
no packed weights, and an attention whose output has the layout CUDA's memory-efficient
kernel returns (a ``(B, M, H, K)`` buffer seen as ``(B, H, M, K)``), so code that only
works on the CPU kernel's contiguous output fails here too.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from agentgym.core.device import capture_graph, graph_pool, is_accelerator, is_capturing
from agentgym.rollout.engines.kv_pool import KVPool
from agentgym.rollout.engines.packed import BLOCKED_MIN, PackedWeights, why_not_packed

logger = logging.getLogger(__name__)

#: model types whose decoder layers are read as Llama's (pre-norm, RoPE, full attention)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
#: batch buckets of the captured decode step
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def why_not_supported(model) -> str | None:
    """Why :class:`ModelRunner` cannot run ``model`` (None: it can)."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "use_sliding_window", False) or (
            kind == "mistral" and getattr(config, "sliding_window", None)):
        return "the model uses sliding-window attention"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"the model has layers of types {sorted(types)}"
    if not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None), "layers"):
        return "the model has no .model.layers / .lm_head"
    return None


def _gated(mlp) -> bool:
    """Whether ``mlp`` is the Llama family's gated MLP (what the runner packs and runs)."""
    return all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _bucket(n: int, buckets) -> int:
    return next((b for b in buckets if b >= n), n)


def column_bucket(n: int) -> int:
    """Columns a captured step attends over: ``n`` rounded up (steps of about 1.5x)."""
    b = 128
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else (b // 3) * 4
    return b


class _LayerPlan:
    """The modules a decoder layer's step reads, looked up once."""

    __slots__ = ("input_norm", "post_norm", "qkv", "o", "qk_norm", "mlp", "gate_up", "down",
                 "act")

    @classmethod
    def of(cls, layer) -> "_LayerPlan":
        p, attn, mlp = cls(), layer.self_attn, layer.mlp
        p.input_norm, p.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        p.qkv, p.o = (attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,)
        p.qk_norm = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        p.mlp, gated = mlp, _gated(mlp)
        p.gate_up = (mlp.gate_proj, mlp.up_proj) if gated else ()
        p.down = (mlp.down_proj,) if gated else ()
        p.act = mlp.act_fn if gated else None
        return p


class ModelRunner:
    """Prefill and decode of a Llama-family model over a :class:`KVPool`."""

    def __init__(self, model, pool: KVPool, graphs: bool = False, packed: bool = True,
                 standin: bool = False, blocked_min: int = BLOCKED_MIN) -> None:
        self.model, self.pool = model, pool
        base = model.model
        self.layers = list(base.layers)
        config = model.config.get_text_config()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.group = self.heads // self.kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.layers[0].self_attn.scaling
        self.device = next(model.parameters()).device
        #: the GPU's code path: SDPA attention, graphs when asked, no packed weights
        self.gpu_path = is_accelerator(self.device) or standin
        self.standin = standin and not is_accelerator(self.device)
        self.graphs = graphs and self.gpu_path
        if self.graphs and pool.growable:
            raise ValueError("captured graphs need a KV pool allocated once (growable=False): "
                             "a graph keeps the addresses of the pool it was captured over")
        self._cos = self._sin = None
        self._graphs: dict[tuple[int, int], object] = {}  # (rows, columns) -> CUDA graph
        self._static: dict[str, torch.Tensor] = {}
        self._graph_pool = None
        self.stats = {"graph_replays": 0, "eager_steps": 0, "graphs": 0,
                      "captured_while_serving": 0, "capture_s": 0.0}
        #: per layer, the modules its step reads (the layers' structure is fixed, as the
        #: packed groups are, when the runner is made): no attribute lookups per step
        self._plan = [_LayerPlan.of(layer) for layer in self.layers]
        #: id of each RMSNorm module -> its epsilon (run as one fused op)
        self._eps = {id(m): m.variance_epsilon for m in model.modules()
                     if type(m).__name__.endswith("RMSNorm")
                     and getattr(m, "variance_epsilon", None) is not None}
        #: on the CPU, the projections and the head over oneDNN-blocked weight copies
        self.packed: PackedWeights | None = None
        if packed and not self.gpu_path:
            why = why_not_packed(pool.dtype)
            if why:
                logger.info("linear weights are not packed: %s", why)
            else:
                self.packed = PackedWeights(self._linears(), blocked_min)

    def _linears(self) -> list:
        """The groups of linears packed together (each reads one input)."""
        out = []
        for p in self._plan:
            out += [p.qkv, p.o]
            if p.gate_up:
                out += [p.gate_up, p.down]
        return out + [(self.model.lm_head,)]

    def _run(self, group: tuple, x: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``group``'s linears of ``x`` (packed where it is)."""
        return [m(x) for m in group] if self.packed is None else self.packed(group, x)

    def _mlp(self, p: "_LayerPlan", x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of the Llama family (``down(act(gate(x)) * up(x))``) over the
        packed weights; any other MLP runs its own forward."""
        if self.packed is None or not p.gate_up:
            return p.mlp(x)
        gate, up = self.packed(p.gate_up, x)
        return self.packed(p.down, p.act(gate) * up)[0]

    # -- rotary table -------------------------------------------------------------------
    def _rotary(self, positions: torch.Tensor, need: int):
        """cos and signed sin ``(*positions.shape, 1, head_dim)`` from a table of at least
        ``need`` positions (built from the model's own rotary embedding for its whole
        context, or ``need`` when more). With graphs the table is built before the first
        capture and never replaced: a captured step keeps reading the table it saw."""
        if self._cos is None or self._cos.shape[0] < need:
            if self._graphs:
                raise ValueError(f"{need} positions asked of a rotary table of "
                                 f"{self._cos.shape[0]} that captured graphs read; the "
                                 "decode pool's columns bound every request's positions")
            config = self.model.config.get_text_config()
            n = max(need, min(getattr(config, "max_position_embeddings", 0) or 0, 1 << 17))
            x = torch.zeros(1, dtype=self.pool.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(
                x, torch.arange(n, device=self.device)[None])
            half = self.head_dim // 2
            self._cos = cos[0]
            self._sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return self._cos[positions][:, :, None], self._sin[positions][:, :, None]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``(N, T, heads, head_dim)``, the halves rotated as
        transformers' ``rotate_half`` does: ``x * cos + [x2, x1] * [-sin, sin]``."""
        flipped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return x * cos + flipped * sin

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """An RMSNorm of the model's as one fused op (the module's own forward is six)."""
        eps = self._eps.get(id(module))
        if eps is None:
            return module(x)
        return F.rms_norm(x, (x.shape[-1],), module.weight, eps)

    # -- the forward --------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                read_slots: torch.Tensor | None, columns: int,
                last: torch.Tensor | None, pool: KVPool | None = None) -> torch.Tensor:
        """Logits of each row's last token.

        Args:
            ids: ``(N, T)`` token ids.
            positions: ``(N, T)`` their positions (= pool columns).
            write_slots: ``(N, T)`` slot each token's keys/values go to (scratch for pads).
            read_slots: ``(N,)`` slot each row attends over; None: slots ``0 .. N-1``.
            columns: columns read (at least every row's last position + 1).
            last: ``(N,)`` index in ``T`` of each row's last token; None: ``T - 1``.
            pool: the pool read and written (default: the decode pool).

        Returns:
            ``(N, vocab)`` logits in the model's dtype.
        """
        n, t = ids.shape
        pool, base = pool or self.pool, self.model.model
        self._announce(ids)
        if self.packed is not None:
            self.packed.refresh()  # a weight written since the last step is packed again
        cos, sin = self._rotary(positions, columns)
        cols = torch.arange(columns, device=self.device)
        mask = (cols[None, None, :] <= positions[:, :, None])[:, None]  # (N, 1, T, C)
        if self.group > 1 and t > 1:
            mask = mask.repeat(1, 1, self.group, 1)  # query order: (head in group, token)
        h = base.embed_tokens(ids)
        bias = self._score_bias(mask, n) if self._by_matmuls(t, h.dtype) else None
        for i, p in enumerate(self._plan):
            q, k, v = self._qkv(p, self._norm(p.input_norm, h), cos, sin)
            pool.k[i][write_slots, :, positions] = k
            pool.v[i][write_slots, :, positions] = v
            if read_slots is None:
                keys, values = pool.k[i][:n, :, :columns], pool.v[i][:n, :, :columns]
            else:
                keys = pool.k[i][:, :, :columns].index_select(0, read_slots)
                values = pool.v[i][:, :, :columns].index_select(0, read_slots)
            q = q.reshape(n, self.kv_heads, self.group * t, self.head_dim)
            o = self._attend(q, keys, values, mask, bias)
            # reshape, not view: CUDA's memory-efficient kernel returns a transposed
            # (N, group * T, kv_heads, head_dim) buffer, whose kv-head and group dims merge
            # only by a copy (the CPU kernel's output is contiguous and merges by a view)
            o = o.reshape(n, self.heads, t, self.head_dim).transpose(1, 2).reshape(n, t, -1)
            h = h + self._run(p.o, o)[0]
            h = h + self._mlp(p, self._norm(p.post_norm, h))
        h = h[:, -1] if last is None else h[torch.arange(n, device=self.device), last]
        return self._run((self.model.lm_head,), self._norm(base.norm, h))[0]

    def _qkv(self, p: "_LayerPlan", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """A layer's queries ``(N, heads, T, head_dim)``, keys and values ``(N, T,
        kv_heads, head_dim)`` of its normed input ``x``, the rotary embedding applied. When
        q/k/v came from one stacked product (packed) the queries and keys are rotated as
        one tensor (they are its leading columns)."""
        n, t = x.shape[:2]
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        y = None if self.packed is None else self.packed.product(p.qkv, x)
        if y is not None and p.qk_norm is None:
            qk = self._rope(y[..., :(heads + kv) * d].unflatten(-1, (heads + kv, d)), cos, sin)
            return (qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:],
                    y[..., (heads + kv) * d:].unflatten(-1, (kv, d)))
        q, k, v = (self._run(p.qkv, x) if y is None else
                   y.split((heads * d, kv * d, kv * d), dim=-1))
        q, k, v = q.reshape(n, t, heads, d), k.reshape(n, t, kv, d), v.reshape(n, t, kv, d)
        if p.qk_norm is not None:  # Qwen3
            q, k = self._norm(p.qk_norm[0], q), self._norm(p.qk_norm[1], k)
        return self._rope(q, cos, sin).transpose(1, 2), self._rope(k, cos, sin), v

    def _by_matmuls(self, t: int, dtype: torch.dtype) -> bool:
        """Whether :meth:`_attend` takes its matmuls (an fp32 decode step on the CPU)."""
        return not self.gpu_path and t == 1 and dtype == torch.float32

    def _score_bias(self, mask: torch.Tensor, n: int) -> torch.Tensor:
        """The decode step's ``(N * kv_heads, 1, C)`` additive mask (0 or -inf), made once
        for every layer's scores."""
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        bias.masked_fill_(~mask, float("-inf"))
        return bias.expand(n, self.kv_heads, 1, -1).reshape(n * self.kv_heads, 1, -1)

    def _attend(self, q, keys, values, mask, bias=None):
        """Attention of ``q`` ``(N, kv_heads, group * T, head_dim)`` over the slots' leading
        columns. An fp32 decode step on the CPU (``bias``, :meth:`_score_bias`) takes two
        batched products, the first adding the mask and scaling as it multiplies: about
        1.45x faster there than SDPA's CPU kernel over the pool's strided columns
        (smollm2-135m's heads, 64 rows x 201 columns: 1.03 vs 1.50 ms a layer). In bf16 the
        matmuls are no faster on strided columns and round the scores to bf16, so SDPA
        stays."""
        if bias is None:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                               scale=self.scale)
            if self.standin:  # the memory-efficient kernel's layout: (N, M, H, K) seen as
                o = o.transpose(1, 2).contiguous().transpose(1, 2)  # (N, H, M, K)
            return o
        n, kv, m, d = q.shape
        scores = torch.baddbmm(bias, q.reshape(n * kv, m, d),
                               keys.reshape(n * kv, -1, d).transpose(1, 2), alpha=self.scale)
        return torch.matmul(torch.softmax(scores, -1), values.reshape(n * kv, -1, d)).view(
            n, kv, m, d)

    # -- steps --------------------------------------------------------------------------
    def _announce(self, ids: torch.Tensor) -> None:
        """The model's forward pre-hooks see each forward's ``input_ids``, as when the
        model itself is called (profilers; the tests' fault injection)."""
        hooks = self.model._forward_pre_hooks
        if hooks and not is_capturing(self.device):
            with_kwargs = self.model._forward_pre_hooks_with_kwargs
            for key, hook in list(hooks.items()):
                if key in with_kwargs:
                    hook(self.model, (), {"input_ids": ids})
                else:
                    hook(self.model, ())

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                slots: torch.Tensor, last: torch.Tensor, columns: int,
                pool: KVPool) -> torch.Tensor:
        """A padded batch of prompt chunks in ``pool``, one row per slot; ``valid``
        ``(N, T)`` marks real tokens (pads write to scratch). Eager: shapes vary."""
        write = torch.where(valid, slots[:, None], pool.scratch)
        return self.forward(ids, positions, write, slots, columns, last, pool)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, columns: int) -> torch.Tensor:
        """One token for each of the live slots ``0 .. B-1``: ``ids``, ``positions``
        ``(B,)``; returns ``(B, vocab)`` logits (a view of a static buffer when graphs
        run: read it before the next step)."""
        b = ids.shape[0]
        if not self.graphs:
            self.stats["eager_steps"] += 1
            slots = torch.arange(b, device=self.device)[:, None]
            return self.forward(ids[:, None], positions[:, None], slots, None, columns, None)
        st = self.static()
        st["ids"][:b].copy_(ids)
        st["positions"][:b].copy_(positions)
        rows, _ = self.bucket(b, columns)
        st["ids"][b:rows].zero_()
        st["positions"][b:rows].zero_()
        return self.replay(b, columns)[:b]

    def replay(self, b: int, columns: int) -> torch.Tensor:
        """The captured decode step over the static inputs (``ids``, ``positions`` of
        :meth:`static`, rows ``b`` up to the bucket's size zero): the logits of the
        bucket's rows, a static buffer. A bucket not captured yet is captured now, over
        the inputs already in place (its warm-ups write what the step writes)."""
        rows, cols = self.bucket(b, columns)
        graph = self._graphs.get((rows, cols))
        if graph is None:
            logger.warning("decode step of %d rows x %d columns captured while serving "
                           "(capture_all did not cover it)", rows, cols)
            self.stats["captured_while_serving"] += 1
            graph = self._capture(rows, cols)
        graph.replay()
        self.stats["graph_replays"] += 1
        return self._static["logits"][:rows]

    def bucket(self, rows: int, columns: int) -> tuple[int, int]:
        """The captured step that serves ``rows`` rows over ``columns`` columns."""
        return (min(_bucket(rows, BATCH_BUCKETS), self.pool.slots),
                min(column_bucket(columns), self.pool.capacity))

    def captured(self) -> set[tuple[int, int]]:
        """The (rows, columns) buckets whose decode step is captured."""
        return set(self._graphs)

    @property
    def rope_table(self) -> torch.Tensor | None:
        """The rotary cosines the forwards read (and captured graphs keep the address of)."""
        return self._cos

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, columns) bucket a decode step over this pool can use, largest
        first (graphs captured in one memory pool reuse the largest one's memory)."""
        rows = sorted({min(b, self.pool.slots) for b in BATCH_BUCKETS if b < self.pool.slots}
                      | {self.pool.slots})
        cols, c = [], 1
        while not cols or cols[-1] < self.pool.capacity:
            c = min(column_bucket(c), self.pool.capacity)
            cols.append(c)
            c += 1
        return sorted(((r, c) for r in rows for c in cols), reverse=True)

    def capture_all(self) -> int:
        """Capture the decode step of every bucket (the engine calls this at start, before
        any row is live: the warm-ups write only into free slots). Returns how many."""
        if not self.graphs:
            return 0
        if self.pool.live:
            raise RuntimeError(f"capture_all with {self.pool.live} live rows: the warm-ups "
                               "would write into their keys/values")
        t0 = time.perf_counter()
        todo = [key for key in self.buckets() if key not in self._graphs]
        st = self.static()
        st["ids"].zero_()
        st["positions"].zero_()
        with torch.inference_mode():
            for rows, cols in todo:
                self._capture(rows, cols)
        seconds = time.perf_counter() - t0
        logger.info("captured %d decode steps (%d batch x %d column buckets) in %.1f s",
                    len(todo), len({r for r, _ in todo}), len({c for _, c in todo}), seconds)
        return len(todo)

    def graph_memory(self):
        """The memory pool every captured step of this runner shares (the sampler's too)."""
        self.static()
        return self._graph_pool

    def static(self) -> dict[str, torch.Tensor]:
        """The static tensors every captured step reads and writes, made once with the
        rotary table before the first capture: ``ids`` and ``positions`` ``(slots,)`` (the
        inputs), ``logits`` ``(slots, vocab)`` (the output)."""
        if not self._static:
            most = self.pool.slots
            self._static = {"ids": torch.zeros(most, dtype=torch.long, device=self.device),
                            "positions": torch.zeros(most, dtype=torch.long,
                                                     device=self.device),
                            "slots": torch.arange(most, device=self.device)[:, None],
                            "logits": torch.empty((most, self.model.lm_head.out_features),
                                                  dtype=self.pool.dtype, device=self.device)}
            self._graph_pool = graph_pool(self.device)
            self._rotary(torch.zeros(1, dtype=torch.long, device=self.device),
                         self.pool.capacity)
        return self._static

    def _capture(self, rows: int, cols: int):
        """Capture the decode step of ``rows`` rows over ``cols`` columns. Every graph
        shares one memory pool, so each copies its logits into a buffer of its own
        allocated outside the pool (another graph's replay may reuse the pool's memory)."""
        st = self.static()
        t0 = time.perf_counter()

        def step() -> None:
            out = self.forward(st["ids"][:rows, None], st["positions"][:rows, None],
                               st["slots"][:rows], None, cols, None)
            st["logits"][:rows].copy_(out)
        graph = capture_graph(step, self._graph_pool, self.device)
        self._graphs[(rows, cols)] = graph
        self.stats["graphs"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        logger.debug("captured the decode step for %d rows x %d columns", rows, cols)
        return graph
