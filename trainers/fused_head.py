"""Per-token log-probabilities (and entropies) of chosen tokens from hidden states, through
the vocabulary head in chunks, with their gradients from one pass.

``head_logprobs(head, hidden, targets, temperature, with_entropy)`` is what the update
calls on the hidden states at the positions the loss reads (:mod:`agentgym.trainers.
packing`). For a plain ``nn.Linear`` head it runs :class:`HeadLogprobs`: the forward goes
over ``chunk`` rows at a time, computing each chunk's fp32 logits once, its
log-normaliser, the targets' log-probabilities and (when asked) the entropies; it keeps
each chunk's log-softmax for the backward while they fit in ``keep_bytes`` (else the
backward recomputes that chunk's logits). The backward turns the upstream gradients of
log-prob and entropy into the logits' gradient in closed form::

    d logp_i / d z = onehot(target_i) - p_i
    d H_i    / d z = -p_i * (log p_i + H_i)

and from it the hidden states' and the head weight's gradients, chunk by chunk: no
``(M, V)`` tensor is kept beyond the saved log-softmax, no autograd graph over the
vocabulary is built, the head's forward is not run twice, and at temperature 1 the logits
are not copied to be divided. Under autocast the matmuls run in the autocast dtype and
everything past them in fp32, as the unfused path does.

Anything else (a sharded head, a LoRA-wrapped head, a head with a bias, vision token
suppression) takes :func:`plain_logprobs` on the gathered rows: the same values, with
autograd. liger-kernel's fused linear losses are GPU (Triton) kernels and fuse a fixed
loss into the head; this one fuses only the log-prob and entropy, so every policy loss of
:mod:`agentgym.trainers.algos` keeps working unchanged (docs/decisions/update.md, "A fused
head").
"""

from __future__ import annotations

import torch

from agentgym.models.plan import HEAD_KEEP_BYTES

#: rows of hidden states projected to the vocabulary at once
CHUNK = 1024
#: the most bytes of fp32 log-softmax the forward keeps for the backward (past it, the
#: backward recomputes the chunks that did not fit); the memory planner counts it
KEEP_BYTES = HEAD_KEEP_BYTES


def _compute_dtype(device_type: str, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _scratch(buf: torch.Tensor | None, rows: int, like: torch.Tensor, cols: int):
    """``(buf, its first rows)``: one fp32 ``(chunk, V)`` block made on first use and
    reused by every chunk after. A fresh block per chunk costs more than its arithmetic on
    the CPU: above glibc's mmap threshold (32 MiB) each one is mapped anew and its pages
    faulted in and zeroed by the kernel, about 100 ms per 200 MB chunk on a 2-core VM,
    where the log-softmax itself takes 45 ms (docs/decisions/update.md, "The fused head's
    `(chunk, V)` blocks are reused")."""
    if buf is None:
        buf = torch.empty(like.shape[0], cols, dtype=torch.float32, device=like.device)
    return buf, buf[:rows]


def _log_softmax_into(h: torch.Tensor, wt: torch.Tensor, cd: torch.dtype,
                      temperature: float, z: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = log-softmax of ``h @ wt`` (``wt``: the head's weight, transposed, in
    ``cd``) over the vocabulary, through ``z`` (scratch for the fp32 logits)."""
    if cd == torch.float32 and h.dtype == torch.float32:
        torch.mm(h, wt, out=z)
    else:  # the product in the autocast dtype, copied up
        z.copy_(h.to(cd) @ wt)
    if temperature != 1.0:
        z.div_(temperature)
    torch.log_softmax(z, -1, out=out)


class HeadLogprobs(torch.autograd.Function):
    """``(logp (M,), entropy (M,) or empty)`` of ``targets`` under ``hidden @ weight.T``.

    Every ``(chunk, V)`` tensor is either kept for the backward (one allocation per kept
    chunk) or one of two scratch blocks reused across chunks; the matmuls are cast
    explicitly (autocast off inside), so their ``out=`` forms apply."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool,
                chunk: int, keep_bytes: int):
        cd = _compute_dtype(hidden.device.type, weight)
        M, V = hidden.shape[0], weight.shape[0]
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(M if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        kept: list[torch.Tensor | None] = []
        budget, zbuf, sbuf = keep_bytes, None, None
        first = hidden[:chunk]  # the scratch blocks' rows
        with torch.autocast(hidden.device.type, enabled=False):
            wt = weight.to(cd).t()
            for a in range(0, M, chunk):
                n = min(chunk, M - a)
                zbuf, z = _scratch(zbuf, n, first, V)
                keep = 0 <= n * V * 4 <= budget  # keep_bytes -1: no backward will run
                if keep:
                    logq = torch.empty(n, V, dtype=torch.float32, device=hidden.device)
                    budget -= n * V * 4
                else:
                    sbuf, logq = _scratch(sbuf, n, first, V)
                _log_softmax_into(hidden[a:a + n], wt, cd, temperature, z, logq)
                logp[a:a + n] = logq.gather(-1, targets[a:a + n, None])[:, 0]
                if with_entropy:  # the logits are spent: exp(log q) goes where they were
                    ent[a:a + n] = -torch.exp(logq, out=z).mul_(logq).sum(-1)
                if keep_bytes >= 0:
                    kept.append(logq if keep else None)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.kept, ctx.cd, ctx.temperature, ctx.chunk = kept, cd, temperature, chunk
        ctx.ent = ent if with_entropy else None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(targets)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets = ctx.saved_tensors
        cd, temperature, chunk = ctx.cd, ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.ent is None:
            g_ent = None
        if (g_logp is None and g_ent is None) or not (want_h or want_w):
            return None, None, None, None, None, None, None
        d_hidden = torch.empty_like(hidden) if want_h else None
        d_weight = None
        zbuf = sbuf = None
        first, V = hidden[:chunk], weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cd)
            for k, a in enumerate(range(0, hidden.shape[0], chunk)):
                h = hidden[a:a + chunk]
                n = h.shape[0]
                logq = ctx.kept[k] if k < len(ctx.kept) else None
                ctx.kept[k:k + 1] = [None] * (k < len(ctx.kept))  # freed as it is used
                if logq is None:  # not kept: the chunk's log-softmax again, in scratch
                    zbuf, z = _scratch(zbuf, n, first, V)
                    sbuf, logq = _scratch(sbuf, n, first, V)
                    _log_softmax_into(h, w.t(), cd, temperature, z, logq)
                # dz = g_lp * (onehot - p) + g_ent * (-p * (log p + H)), in place over logq
                if g_ent is not None:
                    zbuf, p = _scratch(zbuf, n, first, V)
                    torch.exp(logq, out=p)
                    dz = logq.add_(ctx.ent[a:a + n, None]).mul_(g_ent[a:a + n, None].float())
                    if g_logp is not None:
                        dz.add_(g_logp[a:a + n, None].float())
                    dz.mul_(p).neg_()
                else:
                    dz = logq.exp_().mul_(g_logp[a:a + n, None].float().neg())
                del logq
                if g_logp is not None:
                    dz.scatter_add_(-1, targets[a:a + n, None], g_logp[a:a + n, None].float())
                if temperature != 1.0:
                    dz.div_(temperature)
                dzc = dz.to(cd)
                if want_h:
                    if cd == hidden.dtype:
                        torch.mm(dzc, w, out=d_hidden[a:a + n])
                    else:
                        d_hidden[a:a + n] = (dzc @ w).to(hidden.dtype)
                if want_w:
                    hc = h.to(cd)
                    if d_weight is None:
                        d_weight = dzc.t() @ hc
                        d_weight = d_weight.float() if d_weight.dtype != torch.float32 else d_weight
                    elif cd == torch.float32:  # accumulated in place, no (V, H) temporary
                        d_weight.addmm_(dzc.t(), hc)
                    else:
                        d_weight.add_(dzc.t() @ hc)
        ctx.kept = None
        if d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool, entropy_grad: bool = True):
    """Log-probabilities and entropies (detached unless ``entropy_grad``) from
    ``(M, V)`` logits, with autograd."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logq = torch.log_softmax(z, -1)
    logp = logq.gather(-1, targets[:, None])[:, 0]
    if not with_entropy:
        return logp, None
    ent = -(logq.exp() * logq).sum(-1)
    return logp, (ent if entropy_grad else ent.detach())


def fusable(head) -> bool:
    """A plain ``nn.Linear`` without bias whose weight is an ordinary tensor."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(head.weight, DTensor) and not hasattr(head.weight, "ds_id")


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False, entropy_grad: bool = False,
                  chunk: int = CHUNK, keep_bytes: int = KEEP_BYTES):
    """``(logp (M,), entropy (M,) or None)`` of ``targets`` from ``hidden`` ``(M, H)``.

    The entropy is differentiable only with ``entropy_grad``."""
    temperature = float(temperature or 1.0)
    if fusable(head):
        logp, ent = HeadLogprobs.apply(hidden, head.weight, targets, temperature,
                                       with_entropy, chunk or CHUNK,
                                       keep_bytes if torch.is_grad_enabled() else -1)
        if not with_entropy:
            return logp, None
        return logp, (ent if entropy_grad else ent.detach())
    step = chunk or max(1, hidden.shape[0])
    parts = [plain_logprobs(head(hidden[a:a + step]), targets[a:a + step], temperature,
                            with_entropy, entropy_grad)
             for a in range(0, hidden.shape[0], step)]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp = torch.cat([lp for lp, _ in parts])
    return logp, (torch.cat([e for _, e in parts]) if with_entropy else None)
