"""The decode rows on the device, and the step that moves them: forward, sample, advance.

Between two changes of the running rows nothing about them crosses from the host: each
row's next input token, its position, its sampling settings
(:class:`~agentgym.rollout.engines.sampler.RowParams`) and the count of tokens it has
drawn (the counter-based seed's position) live in tensors on the device, and a step
writes its sampled tokens back as the next step's inputs. What reaches the host is one
``(B, 2 + 2K)`` float64 tensor a step (token, logprob, and when some row asks for ``K``
alternatives their logprobs and ids), copied asynchronously.

On a GPU (and the CPU's graph stand-in) the rows live in static buffers, one entry per
pool slot, and a step is two graph replays: the runner's captured forward for the (batch
bucket, column bucket), then the captured sampler for the (batch bucket, sampling mode),
which also advances the inputs. A row joins (:meth:`DecodeRows.join`) by writing its
entries, and leaves (:meth:`DecodeRows.leave`) as the pool moves its last row into the
freed slot, both on the device in stream order: neither waits for the step in flight.
Entries past the live rows are greedy pads at token 0 and position 0. A sampler graph is
captured the first time its mode is seen; its warm-ups run on the real rows, so the
inputs they advance are put back before the step replays.

Elsewhere (the CPU, where a step is synchronous and overlaps nothing) the rows are
rebuilt from the host whenever they change (:meth:`DecodeRows.start`) and the same three
parts run eagerly.
"""

from __future__ import annotations

import torch

from agentgym.core.device import capture_graph, is_accelerator, to_host_async
from agentgym.rollout.engines.model_runner import ModelRunner
from agentgym.rollout.engines.sampler import ROW_TENSORS, RowParams, sample

#: the most alternatives (``top_logprobs``) a captured sampler returns per row
MOST_ALTERNATIVES = 20


class DecodeRows:
    """The running rows' state and their step (see the module)."""

    def __init__(self, runner: ModelRunner, vocab: int) -> None:
        self.runner, self.vocab = runner, vocab
        self.device = runner.device
        self.params: RowParams | None = None  # eager: the rows' settings
        self._tokens: torch.Tensor | None = None  # eager: the next inputs
        self._positions: torch.Tensor | None = None
        self.live: list = []  # captured: each slot's request (its settings)
        self._mode: tuple | None = None  # captured: the live rows' sampling mode
        self._graphs: dict[tuple, object] = {}  # (rows, mode) -> the captured sampler
        self._st: dict[str, torch.Tensor] = {}
        self.stats = {"sampler_graphs": 0, "joins": 0, "leaves": 0}

    # -- eager: rebuilt from the host --------------------------------------------------
    def start(self, tokens: list[int], positions: list[int], params: RowParams) -> None:
        """(Eager) the rows as they now are: each one's next input token and position, and
        their sampling settings (``params``, built for these ``B`` rows)."""
        self.params = params
        self._tokens = torch.tensor(tokens, device=self.device)
        self._positions = torch.tensor(positions, device=self.device)

    # -- captured: changed in place --------------------------------------------------------
    def join(self, slots: list[int], reqs: list, tokens: list[int], positions: list[int]) -> None:
        """(Captured) requests ``reqs`` join at ``slots`` (the pool's next ones), each with
        its next input token and its position."""
        st, inputs = self._buffers(), self.runner.static()
        index = torch.tensor(slots, device=self.device)
        new = RowParams.tensors_of([r.sampling for r in reqs], [r.seed for r in reqs],
                                   [len(r.ids) for r in reqs], self.vocab, self.device)
        new.update(ids=torch.tensor(tokens, device=self.device),
                   at=torch.tensor(positions, device=self.device),
                   live=torch.ones(len(slots), dtype=torch.long, device=self.device))
        for name, target in self._entries(st, inputs).items():
            target.index_copy_(0, index, new[name].to(target.dtype))
        for slot, r in zip(slots, reqs):
            assert slot == len(self.live), (slot, len(self.live))  # the pool's next slot
            self.live.append(r)
        self._mode = None
        self.stats["joins"] += len(slots)

    def leave(self, slot: int) -> None:
        """(Captured) the row at ``slot`` leaves; the last row moves into it, as the pool
        moves its keys/values (:meth:`~agentgym.rollout.engines.kv_pool.KVPool.remove`)."""
        last = len(self.live) - 1
        for name, target in self._entries(self._st, self.runner.static()).items():
            if slot != last:
                target[slot].copy_(target[last])
            target[last].fill_(self._pad(name))
        self.live[slot] = self.live[last]
        self.live.pop()
        self._mode = None
        self.stats["leaves"] += 1

    def reset(self) -> None:
        """(Captured) no row is live: every entry a pad's."""
        if self._st:
            with torch.inference_mode():  # a weight update or a preemption calls this too
                for name, target in self._entries(self._st, self.runner.static()).items():
                    target.fill_(self._pad(name))
        self.live.clear()
        self._mode = None

    def _pad(self, name: str):
        """A pad row's entry ``name`` (top-k off is the vocabulary's size)."""
        return self.vocab if name == "top_k" else _PAD[name]

    @staticmethod
    def _entries(st: dict, inputs: dict) -> dict[str, torch.Tensor]:
        """Every per-slot buffer a row has an entry in, by the name of its value."""
        out = {name: st[name] for name in (*ROW_TENSORS, "truncating", "full_sort", "live")}
        out.update(ids=inputs["ids"], at=inputs["positions"])
        return out

    # -- the step ------------------------------------------------------------------------
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
        b = len(self.live)
        assert b == self.runner.pool.live, (b, self.runner.pool.live)  # joins/leaves mirror it
        if self._mode is None:
            self._mode = RowParams.mode_of([r.sampling for r in self.live], self.vocab)
        self.runner.replay(b, columns)
        rows, _ = self.runner.bucket(b, columns)
        key = (rows, self._mode)
        graph = self._graphs.get(key) or self._capture(rows, key)
        graph.replay()
        out = self._st["out"][:b, :2 + 2 * self._mode[-1]]
        if not is_accelerator(self.device):
            out = out.clone()  # the stand-in: no copy engine, and the next replay writes here
        return to_host_async(out)

    def _buffers(self) -> dict[str, torch.Tensor]:
        if not self._st:
            most, device = self.runner.static()["ids"].shape[0], self.device
            self._st = {name: torch.full((most,), self._pad(name),
                                         dtype=dtype, device=device)
                        for name, dtype in _DTYPES.items()}
            self._st["out"] = torch.zeros((most, 2 + 2 * MOST_ALTERNATIVES),
                                          dtype=torch.float64, device=device)
        return self._st

    def _capture(self, rows: int, key: tuple):
        """The sampler of ``rows`` rows in this mode, captured; the inputs its warm-ups
        advanced are put back."""
        top = key[1][-1]
        if top > MOST_ALTERNATIVES:
            raise ValueError(f"top_logprobs={top}; at most {MOST_ALTERNATIVES} with captured "
                             "graphs (engine.cuda_graphs=false for more)")
        st, inputs = self._st, self.runner.static()
        params = RowParams.over({name: st[name][:rows] for name in _DTYPES}, key[1])
        logits, ids, positions = (inputs["logits"][:rows], inputs["ids"][:rows],
                                  inputs["positions"][:rows])
        live, out = st["live"][:rows], st["out"][:rows, :2 + 2 * top]

        def step() -> None:
            tokens, logps, alternatives = sample(logits, params)
            out.copy_(results(tokens, logps, alternatives))
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


#: a pad row's entries: greedy at temperature 1, no truncation, token 0 at position 0
_PAD = {"temperature": 1.0, "greedy": True, "top_p": 1.0, "top_k": None, "seeds": 0,
        "positions": 0, "truncating": False, "full_sort": False, "live": 0, "ids": 0, "at": 0}
_DTYPES = {"temperature": torch.float32, "greedy": torch.bool, "top_p": torch.float32,
           "top_k": torch.long, "seeds": torch.long, "positions": torch.long,
           "truncating": torch.bool, "full_sort": torch.bool, "live": torch.long}


def results(tokens: torch.Tensor, logps: torch.Tensor, top) -> torch.Tensor:
    """``(B, 2 + 2K)`` float64: token, logprob, then K alternatives' logprobs and ids."""
    cols = [tokens.double()[:, None], logps.double()[:, None]]
    if top is not None:
        cols += [top[0].double(), top[1].double()]
    return torch.cat(cols, dim=1)
