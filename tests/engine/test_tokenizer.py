"""The CLIP tokenizer: the same ids as transformers' CLIPTokenizer (goldens), from either
vocab.json + merges.txt or tokenizer.json, and broken folders refused naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelError
from engine.tokenizer import CLIPTokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> CLIPTokenizer:
    return CLIPTokenizer(tiny_model_dir / "tokenizer")


@pytest.fixture
def tok_dir(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir / "tokenizer", tmp_path / "tokenizer"))


def test_ids_equal_transformers(tok, golden):
    prompts = [str(p) for p in golden["tok_prompts"]]
    ids = tok(prompts)
    assert ids.dtype == np.int64 and ids.shape == (len(prompts), 77)
    np.testing.assert_array_equal(ids, golden["tok_ids"])


def test_layout_bos_eos_padding_truncation(tok):
    empty, long = tok(["", "word " * 200])
    assert empty[0] == tok.bos_token_id and (empty[1:] == tok.eos_token_id).all()
    assert long[0] == tok.bos_token_id and long[-1] == tok.eos_token_id
    assert (long[1:-1] != tok.eos_token_id).all()  # 75 prompt tokens kept, the rest cut


def test_normalization(tok):
    a, b, c = tok(["A  Photo\tOF a\nCat", "a photo of a cat", "  a photo of a cat  "])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(b, c)
    # NFC: a decomposed e + combining accent is the same text as the composed character
    np.testing.assert_array_equal(tok(["cafe\u0301"]), tok(["caf\u00e9"]))


def test_tokenizer_json_gives_the_same_ids(tok, tok_dir, golden):
    # a folder with only tokenizer.json (as transformers saves fast tokenizers)
    tok._tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "vocab.json").unlink()
    (tok_dir / "merges.txt").unlink()
    prompts = [str(p) for p in golden["tok_prompts"]]
    np.testing.assert_array_equal(CLIPTokenizer(tok_dir)(prompts), golden["tok_ids"])


def test_pad_token_comes_from_the_folder(tok_dir):
    # SD 2.x tokenizers pad with "!" instead of <|endoftext|>
    path = tok_dir / "special_tokens_map.json"
    specials = json.loads(path.read_text())
    specials["pad_token"] = "!"
    path.write_text(json.dumps(specials))
    t = CLIPTokenizer(tok_dir)
    vocab = json.loads((tok_dir / "vocab.json").read_text())
    assert t.pad_token_id == vocab["!"]
    row = t(["a cat"])[0]
    assert row[3] == t.eos_token_id and (row[4:] == vocab["!"]).all()


def test_missing_and_corrupt_files_are_named(tok_dir, tmp_path):
    (tok_dir / "merges.txt").unlink()
    with pytest.raises(ModelError, match=r"merges\.txt: file not found"):
        CLIPTokenizer(tok_dir)
    (tok_dir / "merges.txt").write_text("#version: 0.2\nzq xj\n")
    with pytest.raises(ModelError, match=r"merges\.txt: merge 1 \('zq' 'xj'\)"):
        CLIPTokenizer(tok_dir)
    (tok_dir / "vocab.json").write_text("{broken")
    with pytest.raises(ModelError, match=r"vocab\.json: not valid JSON"):
        CLIPTokenizer(tok_dir)
    with pytest.raises(ModelError, match="tokenizer folder missing"):
        CLIPTokenizer(tmp_path / "nowhere")
