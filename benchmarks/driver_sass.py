"""The machine code NVIDIA's Vulkan driver made of one engine kernel, and what its loops spend
their instructions on.

The driver keeps compiled pipelines in its shader disk cache; with the cache pointed at a fresh
folder, the one pipeline compiled there is the only entry. An entry holds zstd frames; inside,
each kernel's instructions end in the `BRA` to itself that closes every NVIDIA kernel, and start
where the instruction words' control bits do (the metadata before them has none). The CUDA
toolkit's `nvdisasm -b SM90` (or the architecture given) disassembles that range. Prints each
backward branch's loop with its instruction mix and writes the SASS.

    python3 benchmarks/driver_sass.py --op linear --variant gemm --dtype f16 \\
        --constants TILE_M=64,TILE_N=128,TILE_K=16,PREFETCH=0 --out gemm.sass

Needs an NVIDIA GPU under Vulkan, the `zstandard` module and nvdisasm (on PATH, or --nvdisasm;
the GPU machine has /usr/local/cuda-13.0/bin/nvdisasm). The layout of the cache entry is the
driver's own and undocumented: what is read here is what driver 580 writes.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ZSTD_MAGIC = bytes.fromhex("28b52ffd")
BRA_SELF = bytes.fromhex("4779fc00fcffffff")  # low word of `BRA` to its own address
INSTRUCTION = 16


def decompress_frames(blob: bytes) -> bytes:
    """The concatenated contents of every zstd frame in `blob`."""
    import zstandard

    out, i = b"", blob.find(ZSTD_MAGIC)
    while i >= 0:
        try:
            out += zstandard.ZstdDecompressor().decompressobj().decompress(blob[i:])
        except zstandard.ZstdError:
            pass  # a magic number inside other data
        i = blob.find(ZSTD_MAGIC, i + len(ZSTD_MAGIC))
    return out


def code_ranges(plain: bytes, floor: int = 0) -> list[tuple[int, int]]:
    """(start, end) byte ranges of the kernels in a decompressed entry: each ends after a branch
    to itself; it starts at the first 16-byte word (aligned with that end) from which 14 of 16
    words carry control bits (byte 14 set, byte 15 small), searched from the previous end."""
    ranges, lo = [], floor
    for m in re.finditer(re.escape(BRA_SELF), plain):
        end = m.start() + INSTRUCTION
        k = lo + (end - lo) % INSTRUCTION
        while k < end:
            words = [plain[j + 14] != 0 and plain[j + 15] < 0x20
                     for j in range(k, min(end, k + 16 * INSTRUCTION), INSTRUCTION)]
            if words[0] and sum(words) >= min(14, len(words)):
                break
            k += INSTRUCTION
        ranges.append((k, end))
        lo = end
    return ranges


def loops(sass: str) -> list[dict]:
    """Each backward branch of a disassembly: the loop's address range and instruction mix."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    out = []
    for addr, text in ins:
        b = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:
            top = int(b.group(1), 16)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if top <= a <= addr)
            out.append({"from": top, "to": addr, "instructions": sum(ops.values()), "mix": dict(ops.most_common())})
    return out


def compile_into_cache(args) -> None:
    """Child process: the driver's cache is set by environment before the driver loads."""
    import engine.ops  # noqa: F401  (registers the variants)
    from engine.device import get_gpu
    from engine.kernels import PipelineCache, variants

    gpu = get_gpu()
    consts = {}
    for item in filter(None, args.constants.split(",")):
        name, value = item.split("=")
        consts[name] = int(value)
    v = variants(args.op)[args.variant]
    PipelineCache(gpu).get(v, args.dtype, consts, args.entry or v.entry)
    gpu.device.queue.submit([])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--entry")
    ap.add_argument("--constants", default="", help="NAME=VALUE,... override constants")
    ap.add_argument("--arch", default="SM90")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "/usr/local/cuda-13.0/bin/nvdisasm")
    ap.add_argument("--out", type=Path, required=True, help="the SASS text")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        compile_into_cache(args)
        return 0
    cache = Path(tempfile.mkdtemp(prefix="nv-shader-cache-"))
    env = dict(os.environ, __GL_SHADER_DISK_CACHE="1", __GL_SHADER_DISK_CACHE_PATH=str(cache),
               __GL_SHADER_DISK_CACHE_SKIP_CLEANUP="1")
    subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child"],
                   env=env, check=True)
    entries = sorted(cache.rglob("*.bin"), key=lambda p: p.stat().st_size)
    if not entries:
        print(f"the driver wrote no shader cache under {cache}: not NVIDIA's Vulkan driver?", file=sys.stderr)
        return 2
    plain = decompress_frames(entries[-1].read_bytes())
    ranges = code_ranges(plain)
    if not ranges:
        print("no kernel code found in the cache entry (a driver whose layout differs)", file=sys.stderr)
        return 2
    start, end = ranges[-1]  # the pipeline compiled last: ours
    raw = cache / "kernel.raw"
    raw.write_bytes(plain[start:end])
    done = subprocess.run([args.nvdisasm, "-b", args.arch, str(raw)], capture_output=True, text=True)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return 2
    args.out.write_text(done.stdout)
    print(f"{args.op}/{args.variant} {args.dtype} {args.constants or 'defaults'}: "
          f"{(end - start) // INSTRUCTION} instructions -> {args.out}")
    for lp in loops(done.stdout):
        fma = sum(n for op, n in lp["mix"].items() if op.split(".")[0] in ("HFMA2", "FFMA", "HMUL2", "HADD2", "FADD", "FMUL"))
        print(f"  loop {lp['from']:#06x}-{lp['to']:#06x}: {lp['instructions']} instructions, "
              f"{fma / lp['instructions']:.0%} float arithmetic; " +
              ", ".join(f"{op} {n}" for op, n in list(lp["mix"].items())[:10]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
