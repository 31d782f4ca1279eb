"""The CLIP tokenizer of SD 1.x prompts, built on the `tokenizers` library.

This module owns turning prompt strings into the (B, 77) int64 id arrays the text encoder
reads, with the same ids transformers' CLIPTokenizer gives when a Stable Diffusion pipeline
calls it with padding="max_length", truncation=True: text normalized (NFC, every whitespace
run made one space, lowercased), split into words with CLIP's pattern, byte-level BPE with
"</w>" marking word ends, then <|startoftext|> + at most 75 ids + <|endoftext|>, padded with
the folder's pad token (SD 1.4 pads with <|endoftext|>, some later models with "!").

The vocabulary comes from a diffusers-layout tokenizer/ folder: vocab.json + merges.txt, or
tokenizer.json when present (transformers prefers it too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE

from engine.errors import ModelError

# Words, as CLIP's reference tokenizer splits them: its special tokens, English contractions,
# letter runs, single digits, and runs of other non-space characters.
CLIP_WORD_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
END_OF_WORD = "</w>"
DEFAULT_SPECIALS = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e}") from None
    except ValueError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value, path: Path, key: str) -> tuple[str, bool]:
    """A special token entry is a string or an AddedToken dict; returns (text, normalized)."""
    if isinstance(value, str):
        return value, False
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"], bool(value.get("normalized", False))
    raise ModelError(f"{path}: {key}={value!r}; expected a token string or an AddedToken object")


def build_clip_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], unk: str) -> Tokenizer:
    """A `tokenizers` pipeline that splits and merges exactly like CLIP's BPE (no specials)."""
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk,
            continuing_subword_prefix="",
            end_of_word_suffix=END_OF_WORD,
            fuse_unk=False,
        )
    )
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # invert=True: the pattern matches the words to keep; what lies between goes.
            pre_tokenizers.Split(Regex(CLIP_WORD_PATTERN), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    return tok


def read_merges(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e}") from None
    merges = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ModelError(
                f"{path}: line {n} is {line!r}; expected two tokens separated by a space"
            )
        merges.append((parts[0], parts[1]))
    return merges


class CLIPTokenizer:
    """Callable: ``tokenizer(["a cat", ""]) -> (2, 77) int64``."""

    def __init__(self, tokenizer_dir: Path | str, model_max_length: int | None = None):
        d = Path(tokenizer_dir)
        if not d.is_dir():
            raise ModelError(f"{d}: tokenizer folder missing; expected vocab.json and merges.txt")
        # Special tokens: defaults, then tokenizer_config.json, then special_tokens_map.json,
        # the order in which transformers lets them override each other.
        specials: dict[str, tuple[str, bool]] = {k: (v, False) for k, v in DEFAULT_SPECIALS.items()}
        config: dict = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            path = d / name
            if path.is_file():
                data = _read_json(path)
                if name == "tokenizer_config.json":
                    config = data
                for key in DEFAULT_SPECIALS:
                    if data.get(key) is not None:
                        specials[key] = _token_content(data[key], path, key)

        if model_max_length is None:
            # SD 1.x configs say 77; a folder without it would get transformers' "unlimited"
            # sentinel, which no text encoder accepts, so fall back to CLIP's 77 positions.
            model_max_length = config.get("model_max_length", 77)
            if not isinstance(model_max_length, int) or not 2 < model_max_length <= 4096:
                model_max_length = 77
        self.model_max_length = int(model_max_length)

        tokenizer_json = d / "tokenizer.json"
        if tokenizer_json.is_file():
            try:
                self._tok = Tokenizer.from_file(str(tokenizer_json))
            except Exception as e:  # tokenizers raises plain Exception on bad files
                raise ModelError(f"{tokenizer_json}: not a valid tokenizer.json ({e})") from None
            # BOS/EOS, truncation and padding are applied in __call__, the same for both
            # sources, so the file's own settings are switched off.
            self._tok.no_padding()
            self._tok.no_truncation()
        else:
            vocab_path, merges_path = d / "vocab.json", d / "merges.txt"
            for p in (vocab_path, merges_path):
                if not p.is_file():
                    raise ModelError(
                        f"{p}: file not found; a CLIP tokenizer needs vocab.json and merges.txt"
                    )
            vocab = _read_json(vocab_path)
            if not all(isinstance(v, int) for v in vocab.values()):
                raise ModelError(f"{vocab_path}: expected an object of token -> integer id")
            merges = read_merges(merges_path)
            for n, (a, b) in enumerate(merges, 1):
                if a not in vocab or b not in vocab or a + b not in vocab:
                    raise ModelError(
                        f"{merges_path}: merge {n} ({a!r} {b!r}) uses or makes a token missing "
                        f"from {vocab_path.name}; the two files do not belong together"
                    )
            try:
                self._tok = build_clip_bpe(vocab, merges, specials["unk_token"][0])
            except Exception as e:
                raise ModelError(f"{d}: cannot build the BPE model ({e})") from None

        # Prompts may spell the special tokens out; like transformers, match them as whole
        # tokens before BPE (after normalization when the folder says normalized=true).
        self._tok.add_special_tokens(
            [
                AddedToken(text, special=True, normalized=normalized)
                for text, normalized in dict.fromkeys(specials.values())
            ]
        )
        ids = {}
        for key, (text, _) in specials.items():
            i = self._tok.token_to_id(text)
            if i is None:
                raise ModelError(f"{d}: {key} {text!r} is not in the vocabulary")
            ids[key] = i
        self.bos_token_id = ids["bos_token"]
        self.eos_token_id = ids["eos_token"]
        self.pad_token_id = ids["pad_token"]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """BPE ids of one text, without BOS/EOS, not truncated."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def __call__(self, texts: list[str] | str) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        n = self.model_max_length
        out = np.full((len(texts), n), self.pad_token_id, dtype=np.int64)  # (B, 77)
        for b, enc in enumerate(self._tok.encode_batch(list(texts), add_special_tokens=False)):
            body = enc.ids[: n - 2]  # room for BOS and EOS: truncation keeps the prompt's start
            row = [self.bos_token_id, *body, self.eos_token_id]
            out[b, : len(row)] = row
        return out
