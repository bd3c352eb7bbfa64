"""The tokenizer every service loads (shared.model_source.load_tokenizer): the same
tokenizer AutoTokenizer gives, without importing torch where the folder names the generic
fast tokenizer (the gateway's process never needs torch)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from transformers import AutoTokenizer

from shared.model_source import ModelSource, load_tokenizer, resolve_model
from tests.conftest import REPO

TEXTS = ["Hello world", " leading space", "<|im_start|>user\nhi<|im_end|>",
         "日本語 and emoji 🎉", "tabs\tand\nnewlines  ", ""]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo wörld 🌍\n\tcode"}]


def _same(tok, ref) -> None:
    assert type(tok) is type(ref)
    assert tok.get_vocab() == ref.get_vocab() and len(tok) == len(ref)
    assert tok.all_special_ids == ref.all_special_ids
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
        ids = ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_the_bundled_tokenizer_equals_autotokenizers():
    source = resolve_model()
    load_tokenizer(source)                      # converted from the GGUF once, then cached
    folder = source.cache_dir
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] \
        in ("TokenizersBackend", "PreTrainedTokenizerFast")
    _same(load_tokenizer(source), AutoTokenizer.from_pretrained(folder))


def test_loading_the_bundled_tokenizer_imports_no_torch():
    code = ("import sys; from shared.model_source import load_tokenizer, resolve_model; "
            "load_tokenizer(resolve_model()); load_tokenizer(resolve_model()); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_folder_naming_another_class_goes_through_autotokenizer(tmp_path):
    source = resolve_model()
    load_tokenizer(source)
    folder = tmp_path / "gpt2-named"
    shutil.copytree(source.cache_dir, folder,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _same(load_tokenizer(ModelSource("gpt2-named", folder, None)),
          AutoTokenizer.from_pretrained(folder))
