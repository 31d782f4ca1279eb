"""Reading model weights from safetensors files into numpy arrays, checked against a blueprint.

This module owns the on-disk side of weights: where a diffusers-layout component keeps its
tensors (single file, fp16 variant, or shards with an index), what a safetensors file must
look like to be trusted (header, offsets, sizes, dtypes), and the checks that every parameter
the blueprint (engine.models.params) names is present with its exact shape. Tensors come back
in their stored precision (float32 or float16); bfloat16, which numpy lacks, is widened to
float32 exactly. Pickle formats (.bin/.ckpt) are refused: loading them runs arbitrary code.
It also writes safetensors files tensor by tensor, for make_model and single_file.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from engine.errors import ModelError

# Base file name of each component's weights, as diffusers and transformers write them.
WEIGHT_STEMS = {
    "text_encoder": "model",
    "unet": "diffusion_pytorch_model",
    "vae": "diffusion_pytorch_model",
}
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")

_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_FLOAT_DTYPES = ("F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype tag: "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header without reading tensor data.

    A file cut short (an interrupted download) is caught here, naming the first tensor whose
    bytes are missing.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(
                    f"{path}: {size} bytes, too short for a safetensors file (truncated or empty)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelError(
                    f"{path}: header claims {n} bytes but the file has {size}; the file is "
                    "truncated or not safetensors"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"{path}: corrupt safetensors header ({e})") from None

    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(int(x) for x in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(
                f"{path}: corrupt header entry for tensor {name!r}: {entry!r}"
            ) from None
        item = _ITEMSIZE.get(dtype)
        if item is None:
            raise ModelError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if end - begin != item * math.prod(shape) or begin < 0:
            raise ModelError(
                f"{path}: tensor {name!r} ({dtype} {list(shape)}) has data_offsets "
                f"[{begin}, {end}], which do not match its size; the file is corrupt"
            )
        if data_start + end > size:
            raise ModelError(
                f"{path}: tensor {name!r} needs bytes up to {data_start + end} but the file has "
                f"{size}; the file is truncated (re-download or re-convert it)"
            )
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    return SafetensorsHeader(path, tensors, dict(metadata))


def _read_bf16(path: Path, info: TensorInfo) -> np.ndarray:
    # bfloat16 is the top half of a float32: shifting its bits up 16 gives the exact value.
    bits = np.fromfile(path, dtype="<u2", count=math.prod(info.shape), offset=info.begin)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(info.shape)


class TensorFile:
    """An open safetensors file: ``get(name)`` reads one tensor (use as a context manager)."""

    def __init__(self, header: SafetensorsHeader):
        self.header = header
        try:
            self._ctx = safe_open(str(header.path), framework="np")
            self._f = self._ctx.__enter__()
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{header.path}: cannot open ({e}); the file is corrupt") from None

    def get(self, name: str) -> np.ndarray:
        info = self.header.tensors[name]
        try:
            if info.dtype == "BF16":
                return _read_bf16(self.header.path, info)
            return self._f.get_tensor(name)
        except (SafetensorError, OSError, TypeError) as e:
            raise ModelError(f"{self.header.path}: cannot read tensor {name!r} ({e})") from None

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensors(header: SafetensorsHeader, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Read the named tensors of one file (names must be in the header)."""
    with TensorFile(header) as f:
        return {name: f.get(name) for name in names}


_ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}


def write_safetensors(
    path: Path,
    specs: Mapping[str, tuple[tuple[int, ...], type]],
    make: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file whose tensors are produced one at a time by ``make(name)``.

    ``specs`` maps name -> (shape, numpy dtype) and fixes the layout, in its order; the header
    is written from it first, so only the current tensor is ever in memory (SD 1.4 is 4.3 GB
    in fp32). Put 8-byte dtypes first to keep every tensor aligned.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt", **dict(metadata or {})}}
    offset = 0
    for name, (shape, dtype) in specs.items():
        dt = np.dtype(dtype)
        if dt not in _ST_DTYPE:
            raise ValueError(f"{name}: cannot write dtype {dt}; expected float32, float16 or int64")
        n = dt.itemsize * math.prod(shape)
        header[name] = {
            "dtype": _ST_DTYPE[dt],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as safetensors writes it
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in specs.items():
            a = np.ascontiguousarray(make(name), dtype=np.dtype(dtype).newbyteorder("<"))
            if a.shape != tuple(shape):
                raise ValueError(f"{name}: got shape {a.shape}, the layout says {tuple(shape)}")
            f.write(a.tobytes())
    tmp.replace(path)  # never leave a half-written file under the real name


# ---------------------------------------------------------------------------------------------
# locating a component's files


def _variant_name(stem: str, variant: str | None, suffix: str) -> str:
    return f"{stem}.{variant}{suffix}" if variant else f"{stem}{suffix}"


def _index_name(stem: str, variant: str | None) -> str:
    return (
        f"{stem}.safetensors.index.{variant}.json" if variant else f"{stem}.safetensors.index.json"
    )


def find_weight_files(component_dir: Path, stem: str, variant: str | None = None) -> list[Path]:
    """The safetensors files holding a component, in the order diffusers would pick them.

    Preference: the requested variant, then the plain files, then (when nothing else is there)
    any variant, so an fp16-only download still loads.
    """
    if not component_dir.is_dir():
        raise ModelError(f"{component_dir}: component folder missing")

    def candidates(v: str | None) -> list[Path] | None:
        single = component_dir / _variant_name(stem, v, ".safetensors")
        if single.is_file():
            return [single]
        index = component_dir / _index_name(stem, v)
        if index.is_file():
            return _shards_from_index(index)
        return None

    for v in ([variant] if variant else []) + [None]:
        found = candidates(v)
        if found:
            return found
    others = sorted(component_dir.glob(f"{stem}.*.safetensors")) + sorted(
        component_dir.glob(f"{stem}.safetensors.index.*.json")
    )
    for path in others:
        if path.suffix == ".safetensors" and "-of-" not in path.name:
            return [path]
        if path.suffix == ".json":
            return _shards_from_index(path)

    pickles = sorted(p.name for p in component_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelError(
            f"{component_dir}: only pickle weights ({', '.join(pickles)}); they are refused "
            "because loading pickle can run arbitrary code. Convert them to safetensors "
            f"(e.g. load with diffusers/transformers and save_pretrained(..., "
            f"safe_serialization=True)) to get {stem}.safetensors"
        )
    raise ModelError(
        f"{component_dir}: no weights found; expected {stem}.safetensors, "
        f"{_variant_name(stem, 'fp16', '.safetensors')} or {_index_name(stem, None)} with shards"
    )


def _shards_from_index(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{index}: not a valid shard index ({e}); expected a weight_map") from None
    shards = []
    for fname in dict.fromkeys(weight_map.values()):
        if "/" in fname or "\\" in fname or fname.startswith("."):
            raise ModelError(f"{index}: shard name {fname!r} must be a plain file name")
        path = index.parent / fname
        if not path.is_file():
            raise ModelError(
                f"{index}: lists shard {fname!r}, which is missing from {index.parent}"
            )
        shards.append(path)
    if not shards:
        raise ModelError(f"{index}: weight_map is empty")
    return shards


# ---------------------------------------------------------------------------------------------


def _canonical_names(component: str, names: Iterable[str]) -> dict[str, str]:
    """Map file keys to blueprint keys.

    transformers >= 5.6 saves CLIPTextModel without the "text_model." prefix that every SD 1.x
    checkpoint (and the blueprint) uses; both spellings are the same weights.
    """
    names = list(names)
    if component == "text_encoder" and not any(n.startswith("text_model.") for n in names):
        return {n: f"text_model.{n}" for n in names}
    return {n: n for n in names}


def check_shapes(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[tuple[int, ...], str, Path]],
    where: str,
) -> None:
    """Every expected key present, with its exact shape and a float dtype; extras ignored.

    ``found`` maps key -> (shape, safetensors dtype, file).
    """
    missing = [k for k in expected if k not in found]
    if missing:
        files = sorted({str(p) for _, _, p in found.values()}) or [where]
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        shown = ", ".join(repr(k) for k in missing[:3])
        raise ModelError(
            f"{', '.join(files)}: missing tensor {shown}{more}; the {where} weights do not "
            "match its config"
        )
    for key, shape in expected.items():
        got, dtype, path = found[key]
        if tuple(got) != tuple(shape):
            raise ModelError(
                f"{path}: tensor {key!r} has shape {list(got)}, expected {list(shape)} from the "
                "config; weights and config belong to different models"
            )
        if dtype not in _FLOAT_DTYPES:
            raise ModelError(
                f"{path}: tensor {key!r} is {dtype}; expected float32, float16 or bfloat16"
            )


def load_component(
    model_dir: Path | str,
    component: str,
    expected: Mapping[str, tuple[int, ...]],
    variant: str | None = None,
) -> dict[str, np.ndarray]:
    """Load one component ("text_encoder", "unet" or "vae") of a diffusers-layout model.

    Returns {blueprint key: array} in the blueprint's order, each float32 or float16 as
    stored (bfloat16 widened to float32). Keys the blueprint does not name (position_ids,
    EMA leftovers) are ignored.
    """
    source = component_tensors(model_dir, component, variant)
    found = {k: (h.tensors[fk].shape, h.tensors[fk].dtype, h.path) for k, (h, fk) in source.items()}
    check_shapes(expected, found, component)

    by_file: dict[Path, tuple[SafetensorsHeader, list[str]]] = {}
    for key in expected:
        h = source[key][0]
        by_file.setdefault(h.path, (h, []))[1].append(key)
    arrays: dict[str, np.ndarray] = {}
    for h, keys in by_file.values():
        data = read_tensors(h, [source[k][1] for k in keys])
        arrays.update({k: data[source[k][1]] for k in keys})
    return {k: arrays[k] for k in expected}


def component_tensors(
    model_dir: Path | str, component: str, variant: str | None = None
) -> dict[str, tuple[SafetensorsHeader, str]]:
    """Every tensor of a component's files, without reading data: {blueprint-style key:
    (header of its file, its key in that file)}."""
    if component not in WEIGHT_STEMS:
        raise ValueError(f"unknown component {component!r}; expected one of {list(WEIGHT_STEMS)}")
    files = find_weight_files(Path(model_dir) / component, WEIGHT_STEMS[component], variant)
    source: dict[str, tuple[SafetensorsHeader, str]] = {}
    for h in (read_header(p) for p in files):
        for file_key, key in _canonical_names(component, h.tensors).items():
            source[key] = (h, file_key)
    return source


def numpy_dtype(tag: str) -> np.dtype:
    """The dtype load_component returns for a stored safetensors dtype tag."""
    return np.dtype(np.float16) if tag == "F16" else np.dtype(np.float32)
