"""The decode rows on the device, and the step that moves them: forward, sample, advance.

Between two changes of the running rows (a join or a leave) nothing about them crosses
from the host: each row's next input token, its position, its sampling settings
(:class:`~agentgym.rollout.engines.sampler.RowParams`) and the count of tokens it has
drawn (the counter-based seed's position) live in tensors on the device, and a step
writes its sampled tokens back as the next step's inputs. What reaches the host is one
``(B, 2 + 2K)`` float64 tensor a step (token, logprob, and when some row asks for ``K``
alternatives their logprobs and ids), copied asynchronously.

On a GPU (and the CPU's graph stand-in) everything lives in static buffers and a step is
two graph replays: the runner's captured forward for the (batch bucket, column bucket),
then the captured sampler for the (batch bucket, sampling mode), which also advances the
inputs. Rows past the live ones up to the bucket are greedy pads whose position stays 0.
A sampler graph is captured the first time its mode is seen; its warm-ups run on the real
rows, so the inputs they advance are put back before the step replays. Elsewhere the same
three parts run eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from agentgym.core.device import is_accelerator, to_host_async
from agentgym.rollout.engines.model_runner import ModelRunner
from agentgym.rollout.engines.sampler import RowParams, sample

#: RowParams' per-row tensors (the rest are the flags that key a captured sampler)
_ROW_TENSORS = ("temperature", "greedy", "top_p", "top_k", "seeds", "positions")


class DecodeRows:
    """The running rows' state and their step (see the module)."""

    def __init__(self, runner: ModelRunner, vocab: int) -> None:
        self.runner, self.vocab = runner, vocab
        self.device = runner.device
        self.b = 0
        self.params: RowParams | None = None
        self._tokens: torch.Tensor | None = None  # eager: the next inputs
        self._positions: torch.Tensor | None = None
        self._graphs: dict[tuple, object] = {}  # (rows, mode) -> the captured sampler
        self._st: dict[str, torch.Tensor] = {}
        self.stats = {"sampler_graphs": 0}

    def start(self, tokens: list[int], positions: list[int], params: RowParams) -> None:
        """The rows as they now are: each one's next input token and its position, and
        their sampling settings (``params``, built for these ``B`` rows)."""
        self.b, self.params = len(tokens), params
        device = self.device
        if not self.runner.graphs:
            self._tokens = torch.tensor(tokens, device=device)
            self._positions = torch.tensor(positions, device=device)
            return
        st, inputs = self._buffers(), self.runner.static()
        most, b = inputs["ids"].shape[0], self.b
        host = {"ids": tokens + [0] * (most - b), "positions": positions + [0] * (most - b),
                "live": [1] * b + [0] * (most - b)}
        for name, values in host.items():  # one copy each from the host
            target = inputs[name] if name in inputs else st[name]
            target.copy_(torch.tensor(values, dtype=target.dtype))
        pad = RowParams.build([_GREEDY] * (most - b), [0] * (most - b), [0] * (most - b),
                              self.vocab, device) if most > b else None
        for name in _ROW_TENSORS:
            st[name][:b].copy_(getattr(params, name))
            if pad is not None:
                st[name][b:].copy_(getattr(pad, name))
        for name in ("truncating", "full_sort"):
            value = getattr(params, name)
            st[name][:b].copy_(value) if value is not None else st[name][:b].zero_()
            st[name][b:].zero_()

    def step(self, columns: int):
        """One decode step of the rows over ``columns`` columns: ``(host, event)``, the
        step's ``(B, 2 + 2K)`` results on their way to the host (see
        :func:`~agentgym.core.device.to_host_async`)."""
        if not self.runner.graphs:
            logits = self.runner.decode(self._tokens, self._positions, columns)
            tokens, logps, top = sample(logits, self.params)
            self._tokens, self._positions = tokens, self._positions + 1
            self.params.positions = self.params.positions + 1
            return to_host_async(results(tokens, logps, top))
        b = self.b
        self.runner.replay(b, columns)
        rows, _ = self.runner.bucket(b, columns)
        key = (rows, self.params.mode())
        graph = self._graphs.get(key) or self._capture(rows, key)
        graph.replay()
        out = self._st["out"][:b, :2 + 2 * self.params.top_logprobs]
        if not is_accelerator(self.device):
            out = out.clone()  # the stand-in: no copy engine, and the next replay writes here
        return to_host_async(out)

    # -- the captured sampler ------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        if not self._st:
            most, device = self.runner.static()["ids"].shape[0], self.device
            pad = RowParams.build([_GREEDY] * most, [0] * most, [0] * most, self.vocab, device)
            self._st = {name: getattr(pad, name).clone() for name in _ROW_TENSORS}
            self._st.update(
                truncating=torch.zeros(most, dtype=torch.bool, device=device),
                full_sort=torch.zeros(most, dtype=torch.bool, device=device),
                live=torch.zeros(most, dtype=torch.long, device=device),
                out=torch.zeros((most, 2 + 2 * _MOST_ALTERNATIVES), dtype=torch.float64,
                                device=device))
        return self._st

    def _capture(self, rows: int, key: tuple):
        """The sampler of ``rows`` rows in this mode, captured; the inputs its warm-ups
        advanced are put back."""
        from agentgym.core.device import capture_graph
        st, inputs, flags = self._st, self.runner.static(), self.params
        if flags.top_logprobs > _MOST_ALTERNATIVES:
            raise ValueError(f"top_logprobs={flags.top_logprobs}; at most "
                             f"{_MOST_ALTERNATIVES} with captured graphs")
        k = flags.top_logprobs
        params = dataclasses.replace(
            flags, **{name: st[name][:rows] for name in _ROW_TENSORS},
            truncating=st["truncating"][:rows] if flags.truncating is not None else None,
            full_sort=st["full_sort"][:rows] if flags.full_sort is not None else None)
        logits, ids, positions = (inputs["logits"][:rows], inputs["ids"][:rows],
                                  inputs["positions"][:rows])
        live, out = st["live"][:rows], st["out"][:rows]

        def step() -> None:
            tokens, logps, top = sample(logits, params)
            out[:, :2 + 2 * k].copy_(results(tokens, logps, top))
            ids.copy_(tokens * live)  # the next step's inputs; pads stay at token 0 ...
            positions.add_(live)  # ... and position 0
            params.positions.add_(live)
        kept = [t.clone() for t in (ids, positions, params.positions)]
        graph = capture_graph(step, self.runner.graph_memory(), self.device)
        for t, old in zip((ids, positions, params.positions), kept):
            t.copy_(old)
        self._graphs[key] = graph
        self.stats["sampler_graphs"] += 1
        return graph


#: the most alternatives (``top_logprobs``) a captured sampler returns per row
_MOST_ALTERNATIVES = 20


def results(tokens: torch.Tensor, logps: torch.Tensor, top) -> torch.Tensor:
    """``(B, 2 + 2K)`` float64: token, logprob, then K alternatives' logprobs and ids."""
    cols = [tokens.double()[:, None], logps.double()[:, None]]
    if top is not None:
        cols += [top[0].double(), top[1].double()]
    return torch.cat(cols, dim=1)


def _greedy():
    from agentgym.core.types import SamplingParams
    return SamplingParams(temperature=0.0)


_GREEDY = _greedy()
