"""Static batches through the model's own forward: for the models the
:class:`~agentgym.rollout.engines.model_runner.ModelRunner` does not run (vision-language
models, whose image tokens share one id whatever the image and whose positions are 3-D;
architectures outside the Llama family) and for ``engine.continuous_batching=false``.

Whatever is waiting is left-padded into one batch and decoded until its last row is done;
a finished row leaves the batch (its keys/values are dropped by index). Sampling is the
same batched draw as the continuous path's (:mod:`agentgym.rollout.engines.sampler`).

:class:`StaticCore` is this path as an engine core (:mod:`agentgym.rollout.engines.core`):
the same ``add_request`` / ``step`` / ``is_finished`` the front's one loop steps, where a
step is one whole batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agentgym.rollout.engines.hf_request import StopCheck, _Request
from agentgym.rollout.engines.sampler import RowParams, sample
from agentgym.models.vision import suppress_vision_tokens, vl_forward_kwargs

logger = logging.getLogger(__name__)


@dataclass
class StaticCore:
    """Static batches as an engine core. Once a request waits, a batch starts when no new
    request has arrived for ``batch_wait_s`` (concurrent callers join it), or
    ``max_batch_wait_s`` after the batch began forming, or at once when
    ``max_batch_size`` wait; :meth:`wait_s` tells the loop how long that is."""

    model: object
    device: object
    pad_id: int
    stops: StopCheck
    stats: dict
    vision: bool
    never: list[int]
    max_batch_size: int
    batch_wait_s: float
    max_batch_wait_s: float
    policy_version: int = 0
    waiting: list[_Request] = field(default_factory=list)
    _forming: float | None = None  # when the batch began forming (admissions open)
    _arrived: float = 0.0  # when the last request arrived

    def add_request(self, r: _Request) -> None:
        self.waiting.append(r)
        self._arrived = time.monotonic()

    def running(self) -> bool:
        return False  # a batch runs inside one step

    def is_finished(self) -> bool:
        return not self.waiting

    def wait_s(self, admit: bool, now: float) -> float | None:
        if not (admit and self.waiting):
            self._forming = None  # paused while forming: the window starts again
            return None
        if len(self.waiting) >= self.max_batch_size:
            return 0.0
        if self._forming is None:
            self._forming = now
        quiet = max(self._forming, self._arrived) + self.batch_wait_s
        return max(0.0, min(quiet, self._forming + self.max_batch_wait_s) - now)

    def step(self, admit: bool = True) -> list:
        """One batch of what waits, decoded to its end (its requests finish inside)."""
        if not admit:
            return []
        batch = [r for r in self.waiting[:self.max_batch_size] if not r.abandoned]
        self.waiting = self.waiting[self.max_batch_size:]
        self._forming = None
        try:
            if batch:
                with torch.inference_mode():
                    run_static(self, batch)
        except BaseException as e:  # noqa: BLE001 - surface every failure to the caller
            logger.exception("generation batch of %d failed", len(batch))
            for r in batch:
                r.fail(e)
        return []

    def preempt(self) -> list:
        return []  # between steps no batch runs

    def abort(self, error: BaseException) -> None:
        for r in self.waiting:
            r.fail(error)
        self.waiting = []

    def update_weights(self, version: int) -> None:
        self.policy_version = version


def run_static(core: StaticCore, reqs: list) -> None:
    """Prefill ``reqs`` as one left-padded batch, then decode until every row is done."""
    t0 = time.perf_counter()
    model, device, stats = core.model, core.device, core.stats
    version = core.policy_version  # constant while a batch runs (updates wait for idle)
    stats["batches"] += 1
    stats["requests"] += len(reqs)
    stats["max_rows"] = max(stats["max_rows"], len(reqs))
    stats["prefilled_tokens"] += sum(len(r.prompt_ids) for r in reqs)
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((len(reqs), width), core.pad_id, dtype=torch.long)
    attn = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        attn[i, width - len(r.prompt_ids):] = 1
    ids, attn = ids.to(device), attn.to(device)
    cache = buffered_cache(model, width + max(r.sampling.max_new_tokens for r in reqs))
    if core.vision:  # pixel values of the rows' images and 3-D positions
        kw = vl_forward_kwargs(model, ids, attn, [r.images for r in reqs])
        last_pos = kw["position_ids"][0, :, -1]  # text from here on: 3 equal components
    else:
        kw = {"position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}
        last_pos = kw["position_ids"][:, -1]
    out = model(input_ids=ids, attention_mask=attn, past_key_values=cache,
                use_cache=True, logits_to_keep=1, **kw)
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    active = list(reqs)
    params = RowParams.build([r.sampling for r in active], [r.seed for r in active],
                             [0] * len(active), logits.shape[-1], device)
    while active:
        stats["decode_steps"] += 1
        tokens, keep = _step(core, logits, params, active, version)
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            attn, last_pos, tokens = attn[index], last_pos[index], tokens[index]
            active = [active[j] for j in keep]
            params = RowParams.build([r.sampling for r in active], [r.seed for r in active],
                                     [len(r.ids) for r in active],
                                     logits.shape[-1], device)
        attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)
        last_pos = last_pos + 1
        step_pos = last_pos[:, None]
        if core.vision:
            step_pos = step_pos[None].expand(3, -1, -1)
        out = model(input_ids=tokens[:, None], attention_mask=attn,
                    position_ids=step_pos, past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
    logger.debug("batch of %d done in %.3fs", len(reqs), time.perf_counter() - t0)


def _step(core: StaticCore, logits: torch.Tensor, params: RowParams, active: list, version: int):
    """Sample the rows' next tokens; finish the rows that are done. Returns the tokens
    (on the device) and the indices of the rows that go on."""
    logits = logits.float()
    if core.never:
        suppress_vision_tokens(logits, core.never)
    tokens, logps, top = sample(logits, params)
    params.positions = params.positions + 1
    both = torch.stack((tokens.double(), logps.double())).cpu().tolist()
    alts: list = [None] * len(active)
    if top is not None:
        values, ids = top[0].tolist(), top[1].tolist()
        alts = [list(zip(ids[j], values[j]))[:r.sampling.top_logprobs]
                if r.sampling.top_logprobs else None for j, r in enumerate(active)]
    keep = []
    for j, r in enumerate(active):
        r.push(int(both[0][j]), both[1][j], alts[j], core.policy_version)
        done = ("stop", None) if r.abandoned else core.stops(r)
        if done is None:
            keep.append(j)
        else:
            core.stats["generated_tokens"] += len(r.ids)
            r.finish(*done, version)
    return tokens, keep


class BufferLayer(DynamicLayer):
    """A KV-cache layer that writes into a pre-allocated buffer.

    transformers' DynamicLayer concatenates the whole cache at every decode step, which
    on CPU costs more than the attention itself for batches of long prompts; this layer
    writes only the new positions and returns views of the filled part.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            cap = max(end, self.capacity, 2 * (0 if self._k is None else self._k.shape[-2]))
            k = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if self._k is not None:
                k[:, :, :self.length] = self._k[:, :, :self.length]
                v[:, :, :self.length] = self._v[:, :, :self.length]
            self._k, self._v = k, v
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


def buffered_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache whose full-attention layers are :class:`BufferLayer`s."""
    cache = DynamicCache(config=model.config.get_text_config())
    cache.layers = [BufferLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache
