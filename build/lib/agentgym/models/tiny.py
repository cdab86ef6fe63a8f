"""The models the project builds itself, in seconds and with no download.

* ``tiny``: a random Qwen2 (hidden 64, 2 layers) with a byte-level BPE trained here on
  the shipped corpus plus the agent protocol's tags (:func:`build_tiny`);
* ``tiny-vl``: a random Qwen2.5-VL with the same tokenizer plus the vision special
  tokens and a PIL image processor (:func:`build_tiny_vl`).

:mod:`agentgym.models.zoo` resolves the names, caches the built folders and loads them.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any

from agentgym.core import paths

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
#: expanded to the image's token count by :mod:`agentgym.models.vision`).
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


def tiny_recipe() -> dict[str, Any]:
    """What a built ``tiny`` folder depends on (a change rebuilds the cached copy)."""
    texts, source = _tiny_training_text()
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]
    return {"model": "tiny", "version": TINY_RECIPE_VERSION, "text_source": source,
            "text_sha256": digest}


def tiny_vl_recipe() -> dict[str, Any]:
    return {**tiny_recipe(), "model": "tiny-vl", "vl_version": TINY_VL_RECIPE_VERSION}

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


def _tiny_tokenizer(vocab_size: int, extra_specials: tuple[str, ...], chat_template: str):
    """The trained BPE wrapped as a left-padding fast tokenizer with the ChatML specials
    (plus ``extra_specials``); returns ``(tokenizer, training texts, their source)``."""
    from transformers import PreTrainedTokenizerFast

    texts, source = _tiny_training_text()
    if source != "corpus":
        logger.warning("%s not found; training the tiny tokenizer on built-in paragraphs",
                       paths.data_dir() / TINY_CORPUS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_bpe(texts, vocab_size), eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, extra_special_tokens=[BOS_TURN_TOKEN, EOS_TOKEN, *extra_specials],
        padding_side="left", model_input_names=["input_ids", "attention_mask"],
        chat_template=chat_template)
    return tokenizer, texts, source


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
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size <= 0 or hidden_size % 4:
        raise ValueError(f"hidden_size={hidden_size} must be a positive multiple of 4 "
                         f"(the tiny model has 4 attention heads)")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below 259 (256 bytes + 3 specials)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, texts, source = _tiny_tokenizer(vocab_size, (), CHATML_TEMPLATE)
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
    from transformers import (GenerationConfig, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, _, _ = _tiny_tokenizer(1024, VISION_TOKENS, CHATML_VL_TEMPLATE)
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
