"""Signed bundles: build/verify round trip, every way a bundle is refused (each naming the
file), content-addressed install, partial re-deploys and interrupted installs."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from agent import bundle as B
from agent import files, packing, uploads
from agent.protocol import Manifest, from_json, to_json


@pytest.fixture
def keys(tmp_path):
    private, public = tmp_path / "keys" / "farm.key", tmp_path / "keys" / "farm.pub"
    B.generate_keypair(private, public)
    return B.load_private_key(private), B.load_public_key(public), private, public


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    files = {
        "engine/__init__.py": b'"""engine"""\n',
        "engine/ops/conv2d.py": b"def conv2d():\n    return 1\n",
        "engine/__pycache__/conv2d.cpython-311.pyc": b"\x00junk",
        "shaders/conv2d/winograd.wgsl": b"@compute @workgroup_size(64) fn main() {}\n",
        "model/unet/diffusion_pytorch_model.safetensors": os.urandom(200_000),
        "model/model_index.json": b'{"_class_name": "StableDiffusionPipeline"}',
        "profiles/adreno.json": b'{"match": {"vendor": "qualcomm"}}',
        "agent/run.sh": b"#!/bin/sh\necho hi\n",
    }
    files["model/unet/copy.safetensors"] = files["model/unet/diffusion_pytorch_model.safetensors"]
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    os.chmod(root / "agent/run.sh", 0o755)
    return root


def build(src: Path, out: Path, private_key, build_id="b1", **overrides) -> Manifest:
    sources = {"engine": src / "engine", "shaders": src / "shaders", "models/tiny": src / "model",
               "profiles/adreno.json": src / "profiles/adreno.json", "agent/run.sh": src / "agent/run.sh"}
    sources.update(overrides)
    return packing.build_bundle(sources, out, build_id, "0.1.0", private_key, source_revision="abc123")


def resign(bundle: Path, private_key, mutate) -> None:
    """Rewrite and re-sign the manifest: what a compromised or buggy build step could emit."""
    manifest = from_json(Manifest, (bundle / B.MANIFEST).read_text())
    mutate(manifest)
    (bundle / B.MANIFEST).write_text(to_json(manifest))
    (bundle / B.SIGNATURE).write_bytes(private_key.sign(manifest.canonical_bytes()))


def store_entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "store").rglob("*") if p.is_file())


# ---- keys, build, verify --------------------------------------------------------------------


def test_keypair_files(keys, tmp_path):
    _, _, private, public = keys
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(B.BundleError, match="refusing to overwrite"):
        B.generate_keypair(private, public)
    os.chmod(private, 0o644)
    with pytest.raises(B.BundleError, match="chmod 600"):
        B.load_private_key(private)
    with pytest.raises(B.BundleError, match="not a PEM"):
        B.load_public_key(private)


def test_build_verify_round_trip(keys, src, tmp_path):
    priv, pub, *_ = keys
    manifest = build(src, tmp_path / "bundle", priv)
    paths = [f.path for f in manifest.files]
    assert paths == sorted(paths)
    assert "engine/ops/conv2d.py" in paths and "models/tiny/unet/diffusion_pytorch_model.safetensors" in paths
    assert not any("__pycache__" in p for p in paths)
    by_path = {f.path: f for f in manifest.files}
    assert by_path["agent/run.sh"].mode == 0o755 and by_path["engine/__init__.py"].mode == 0o644
    data = (src / "engine/ops/conv2d.py").read_bytes()
    assert by_path["engine/ops/conv2d.py"].sha256 == hashlib.sha256(data).hexdigest()
    assert B.verify_bundle(tmp_path / "bundle", pub) == manifest
    assert B.verify_bundle(tmp_path / "bundle", tmp_path / "keys/farm.pub") == manifest


def test_build_follows_source_symlinks_inside_their_link_root(keys, tmp_path):
    priv, pub, *_ = keys
    repo = tmp_path / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "rev"
    blobs.mkdir(parents=True), snapshot.mkdir(parents=True)
    (blobs / "abc").write_bytes(b"weights")
    (snapshot / "unet.safetensors").symlink_to("../../blobs/abc")  # how a Hugging Face snapshot looks
    with pytest.raises(B.BundleError, match="model/unet.safetensors: a link to .*blobs/abc, outside .*snapshots/rev"):
        packing.build_bundle({"model": snapshot}, tmp_path / "refused", "b1", "1", priv)  # its root: itself
    manifest = packing.build_bundle({"model": snapshot}, tmp_path / "bundle", "b1", "1", priv, link_roots={"model": repo})
    assert [f.path for f in manifest.files] == ["model/unet.safetensors"]
    assert not (tmp_path / "bundle/files/model/unet.safetensors").is_symlink()
    assert (tmp_path / "bundle/files/model/unet.safetensors").read_bytes() == b"weights"
    B.verify_bundle(tmp_path / "bundle", pub)


@pytest.mark.parametrize("link", ["key", "passwd", "folder", "loop", "dangling"])
def test_build_refuses_links_out_of_its_sources(keys, src, tmp_path, link):
    """A source tree (a pull request's) that links to the farm's key, /etc/passwd, a folder
    outside, itself, or nothing: one error naming the link and its target, and no bundle."""
    priv, *_ = keys
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for devices")
    made = {"key": ("engine/leak.txt", tmp_path / "keys/farm.key", "outside"),
            "passwd": ("agent/leak2.txt", Path("/etc/passwd"), "outside"),
            "folder": ("engine/more", outside, "outside"),
            "loop": ("engine/ops/again", src / "engine", "a link loop"),
            "dangling": ("engine/gone.py", tmp_path / "no-such-file", "leads nowhere")}
    name, target, says = made[link]
    (src / name).symlink_to(target, target_is_directory=target.is_dir())
    sources = {"engine": src / "engine", "agent": src / "agent"}
    with pytest.raises(B.BundleError) as refused:
        packing.build_bundle(sources, tmp_path / "bundle", "b1", "1", priv, link_roots={k: src for k in sources})
    message = str(refused.value)
    assert message.startswith(f"{name}: ") and says in message and "\n" not in message, message
    assert str(target) in message or os.readlink(src / name) in message, message
    assert not (tmp_path / "bundle").exists() or not any((tmp_path / "bundle").rglob("*"))


def test_a_link_inside_the_tree_is_packed_as_its_file(keys, src, tmp_path):
    priv, pub, *_ = keys
    (src / "engine/alias.py").symlink_to("../agent/run.sh")
    manifest = packing.build_bundle({"engine": src / "engine", "agent": src / "agent"}, tmp_path / "bundle", "b1", "1",
                              priv, link_roots={"engine": src, "agent": src})
    by_path = {f.path: f for f in manifest.files}
    assert by_path["engine/alias.py"].sha256 == by_path["agent/run.sh"].sha256
    assert not (tmp_path / "bundle/files/engine/alias.py").is_symlink()
    B.verify_bundle(tmp_path / "bundle", pub)


def test_build_refuses_bad_input(keys, src, tmp_path):
    priv, *_ = keys
    with pytest.raises(B.BundleError, match="files/../x: path traversal"):
        packing.build_bundle({"../x": src / "agent/run.sh"}, tmp_path / "o1", "b1", "1", priv)
    with pytest.raises(B.BundleError, match="build id"):
        packing.build_bundle({"x": src / "agent/run.sh"}, tmp_path / "o2", "../b", "1", priv)
    (tmp_path / "o3").mkdir(), (tmp_path / "o3" / "f").write_text("x")
    with pytest.raises(B.BundleError, match="not empty"):
        packing.build_bundle({"x": src / "agent/run.sh"}, tmp_path / "o3", "b1", "1", priv)


# ---- refusals -------------------------------------------------------------------------------


@pytest.fixture
def bundle(keys, src, tmp_path):
    build(src, tmp_path / "bundle", keys[0])
    return tmp_path / "bundle"


def test_tampered_file(bundle, keys):
    target = bundle / "files/engine/ops/conv2d.py"
    data = bytearray(target.read_bytes())
    data[0] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(B.BundleError, match=r"^files/engine/ops/conv2d.py: sha256 mismatch$"):
        B.verify_bundle(bundle, keys[1])
    target.write_bytes(bytes(data) + b"more")
    with pytest.raises(B.BundleError, match=r"files/engine/ops/conv2d.py: size mismatch"):
        B.verify_bundle(bundle, keys[1])


def test_tampered_manifest(bundle, keys):
    text = (bundle / B.MANIFEST).read_text().replace('"0.1.0"', '"0.1.1"')
    (bundle / B.MANIFEST).write_text(text)
    with pytest.raises(B.BundleError, match="manifest signature does not verify with the provisioned key"):
        B.verify_bundle(bundle, keys[1])


def test_wrong_key(bundle, tmp_path):
    other = B.generate_keypair(tmp_path / "o.key", tmp_path / "o.pub").public_key()
    with pytest.raises(B.BundleError, match="manifest signature does not verify"):
        B.verify_bundle(bundle, other)


def test_unsigned(bundle, keys):
    (bundle / B.SIGNATURE).unlink()
    with pytest.raises(B.BundleError, match=r"manifest.sig: .*unsigned bundle"):
        B.verify_bundle(bundle, keys[1])


@pytest.mark.parametrize("bad_path, reason", [
    ("../x", "path traversal"),
    ("engine/../../x", "path traversal"),
    ("/etc/passwd", "absolute path"),
    ("C:/Windows/x", "absolute path"),
    ("engine\\x.py", "backslash"),
    ("engine//x.py", "empty or '.'"),
    ("manifest.json", "reserved name"),
])
def test_bad_paths_refused_even_when_signed(bundle, keys, bad_path, reason):
    def mutate(m):
        m.files[0].path = bad_path

    resign(bundle, keys[0], mutate)
    with pytest.raises(B.BundleError, match=re.escape(f"files/{bad_path}: {reason}")):
        B.verify_bundle(bundle, keys[1])


def test_bad_sha_refused(bundle, keys):
    def mutate(m):
        m.files[0].sha256 = "../../../../etc/passwd"

    resign(bundle, keys[0], mutate)
    with pytest.raises(B.BundleError, match="is not 64 lowercase hex"):
        B.verify_bundle(bundle, keys[1])


@pytest.mark.parametrize("chunk_size", [1 << 16, 1 << 20, packing.CHUNK_SIZE])
def test_the_manifest_lists_each_chunks_sha256(keys, src, tmp_path, chunk_size):
    manifest = packing.build_bundle({"models/tiny": src / "model", "agent/run.sh": src / "agent/run.sh"},
                              tmp_path / "out", "b1", "0.1.0", keys[0], chunk_size=chunk_size)
    assert manifest.chunk_size == chunk_size
    for f in manifest.files:
        data = (tmp_path / "out" / B.FILES / f.path).read_bytes()
        want = [hashlib.sha256(data[i:i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)]
        assert f.chunks == want and len(want) == -(-len(data) // chunk_size)
    assert max(len(f.chunks) for f in manifest.files) == -(-200_000 // chunk_size)
    B.verify_bundle(tmp_path / "out", keys[1])
    with pytest.raises(B.BundleError, match="a positive divisor or multiple"):
        packing.build_bundle({"agent/run.sh": src / "agent/run.sh"}, tmp_path / "out2", "b2", "0.1.0", keys[0],
                       chunk_size=3 << 19)


@pytest.mark.parametrize("mutate, reason", [
    (lambda m: m.files[-1].chunks.pop(), "chunk hashes listed"),
    (lambda m: setattr(m, "chunk_size", 1 << 10), "chunk hashes listed"),
    (lambda m: m.files[-1].chunks.__setitem__(0, "../x"), "a chunk sha256 is not 64"),
])
def test_chunk_lists_that_do_not_match_the_sizes_are_refused_even_when_signed(bundle, keys, mutate, reason):
    resign(bundle, keys[0], lambda m: mutate(m) if m.files[-1].chunks else pytest.fail("no chunks"))
    with pytest.raises(B.BundleError, match=reason):
        B.verify_bundle(bundle, keys[1])


def test_symlink_escaping(bundle, keys, tmp_path):
    outside = tmp_path / "secret"
    outside.write_text("x")
    target = bundle / "files/engine/ops/conv2d.py"
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(B.BundleError, match="files/engine/ops/conv2d.py: is a symlink"):
        B.verify_bundle(bundle, keys[1])


def test_symlinked_folder(bundle, keys, tmp_path):
    (bundle / "files/evil").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(B.BundleError, match="files/evil: is a symlink"):
        B.verify_bundle(bundle, keys[1])


def test_extra_file_not_in_manifest(bundle, keys):
    (bundle / "files/engine/extra.py").write_text("import os\n")
    with pytest.raises(B.BundleError, match="files/engine/extra.py: not in the manifest"):
        B.verify_bundle(bundle, keys[1])


def test_extra_top_level_entry(bundle, keys):
    (bundle / "run-me.sh").write_text("rm -rf /\n")
    with pytest.raises(B.BundleError, match="run-me.sh: not part of a bundle"):
        B.verify_bundle(bundle, keys[1])


def test_missing_file_in_full_bundle(bundle, keys):
    (bundle / "files/profiles/adreno.json").unlink()
    with pytest.raises(B.BundleError, match="files/profiles/adreno.json: listed in the manifest but missing"):
        B.verify_bundle(bundle, keys[1])
    assert B.verify_bundle(bundle, keys[1], partial=True).build == "b1"


# ---- install --------------------------------------------------------------------------------


def test_install(bundle, keys, tmp_path):
    root = tmp_path / "agent"
    build = B.install_bundle(bundle, root, keys[1])
    assert build.build_id == "b1" and build.path == root / "builds/b1"
    for f in build.manifest.files:
        tree_file = build.path / f.path
        assert tree_file.read_bytes() == (bundle / "files" / f.path).read_bytes()
        blob = B.blob_path(root, f.sha256)
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == f.sha256
        if f.mode & 0o111:
            assert stat.S_IMODE(tree_file.stat().st_mode) == f.mode and tree_file.stat().st_ino != blob.stat().st_ino
        else:
            assert tree_file.stat().st_ino == blob.stat().st_ino  # hard link into the store
    assert len(store_entries(root)) == len({f.sha256 for f in build.manifest.files})  # dedup
    assert from_json(Manifest, (build.path / B.MANIFEST).read_text()) == build.manifest
    assert (root / "builds/current").is_symlink() and os.readlink(root / "builds/current") == "b1"
    assert B.current_build(root) == build
    assert B.list_builds(root) == [build]
    assert B.missing_files(build.manifest, root) == []


def test_reinstall_is_idempotent(bundle, keys, tmp_path):
    root = tmp_path / "agent"
    first = B.install_bundle(bundle, root, keys[1])
    inode = (first.path / "engine/ops/conv2d.py").stat().st_ino
    before = store_entries(root)
    second = B.install_bundle(bundle, root, keys[1])
    assert second == first
    assert (second.path / "engine/ops/conv2d.py").stat().st_ino == inode  # the tree was kept
    assert store_entries(root) == before
    assert not [p for p in root.rglob(".*") if p.name != ".install.lock"]


def test_install_uses_provisioned_key(bundle, keys, tmp_path):
    root = tmp_path / "agent"
    with pytest.raises(B.BundleError, match="no farm public key is provisioned"):
        B.install_bundle(bundle, root)
    B.provision_public_key(root, keys[3])
    assert B.install_bundle(bundle, root).build_id == "b1"


def test_same_build_id_different_content_refused(bundle, keys, src, tmp_path):
    root = tmp_path / "agent"
    B.install_bundle(bundle, root, keys[1])
    (src / "engine/ops/conv2d.py").write_text("changed\n")
    build(src, tmp_path / "again", keys[0])
    with pytest.raises(B.BundleError, match="build ids are immutable"):
        B.install_bundle(tmp_path / "again", root, keys[1])


def partial_copy(bundle: Path, out: Path, paths: set[str]) -> Path:
    out.mkdir()
    shutil.copy(bundle / B.MANIFEST, out / B.MANIFEST)
    shutil.copy(bundle / B.SIGNATURE, out / B.SIGNATURE)
    for path in paths:
        (out / "files" / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bundle / "files" / path, out / "files" / path)
    return out


def test_missing_files_and_partial_install(bundle, keys, src, tmp_path):
    root = tmp_path / "agent"
    b1 = B.install_bundle(bundle, root, keys[1])
    (src / "engine/ops/conv2d.py").write_text("def conv2d():\n    return 2\n")
    (src / "model/unet/new.safetensors").write_bytes(b"new weights")
    m2 = build(src, tmp_path / "b2-full", keys[0], build_id="b2")
    missing = B.missing_files(m2, root)
    assert sorted(f.path for f in missing) == ["engine/ops/conv2d.py", "models/tiny/unet/new.safetensors"]
    # the store lost a blob (partial store): it is asked for again
    weights = next(f for f in m2.files if f.path.endswith("diffusion_pytorch_model.safetensors"))
    os.chmod(B.blob_path(root, weights.sha256), 0o644)
    B.blob_path(root, weights.sha256).unlink()
    missing = B.missing_files(m2, root)
    assert len(missing) == 3  # copy.safetensors shares the blob: asked for once
    # a re-deploy sends only those
    partial = partial_copy(tmp_path / "b2-full", tmp_path / "b2-partial", {f.path for f in missing})
    b2 = B.install_bundle(partial, root, keys[1])
    assert (b2.path / "engine/ops/conv2d.py").read_text().endswith("return 2\n")
    assert (b2.path / "models/tiny/unet/copy.safetensors").read_bytes() == \
        (src / "model/unet/diffusion_pytorch_model.safetensors").read_bytes()
    assert (b2.path / "shaders/conv2d/winograd.wgsl").stat().st_ino == \
        (b1.path / "shaders/conv2d/winograd.wgsl").stat().st_ino
    assert B.current_build(root).build_id == "b2"
    assert [b.build_id for b in B.list_builds(root)] == ["b1", "b2"]
    assert B.missing_files(m2, root) == []
    # rollback
    assert B.activate_build(root, "b1").build_id == "b1" and B.current_build(root).build_id == "b1"


def test_missing_files_counts_whole_staged_files_of_an_interrupted_upload(bundle, keys, tmp_path):
    manifest = B.verify_bundle(bundle, keys[1])
    staged = tmp_path / "incoming" / manifest.build
    by_size = sorted({f.sha256: f for f in manifest.files}.values(), key=lambda f: f.size)
    whole, damaged, absent = by_size[-1], by_size[-2], by_size[-3]
    for f in (whole, damaged):
        (staged / "files" / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bundle / "files" / f.path, staged / "files" / f.path)
    data = bytearray((staged / "files" / damaged.path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    (staged / "files" / damaged.path).write_bytes(bytes(data))
    missing = {f.sha256 for f in B.missing_files(manifest, tmp_path / "agent", staged=staged)}
    assert whole.sha256 not in missing
    assert {damaged.sha256, absent.sha256} <= missing
    assert missing == {f.sha256 for f in manifest.files} - {whole.sha256}


@pytest.fixture
def chunked(keys, src, tmp_path):
    """A bundle with 64 KiB chunks (its 200,000-byte weights have 4), staged with its signed
    manifest on an agent root provisioned with the farm key."""
    manifest = packing.build_bundle({"models/tiny": src / "model"}, tmp_path / "chunked", "c1", "0.1.0", keys[0],
                              chunk_size=64 << 10)
    root, staging = tmp_path / "agent", tmp_path / "agent/incoming/c1"
    B.provision_public_key(root, keys[1])
    staging.mkdir(parents=True)
    for name in (B.MANIFEST, B.SIGNATURE):
        shutil.copy(tmp_path / "chunked" / name, staging / name)
    weights = max(manifest.files, key=lambda f: f.size)
    return manifest, root, staging, weights, (tmp_path / "chunked/files" / weights.path).read_bytes()


def test_a_file_arrives_a_verified_chunk_at_a_time_and_a_cut_keeps_the_whole_chunks(chunked):
    manifest, root, staging, weights, data = chunked
    size, target = manifest.chunk_size, staging / "files" / weights.path
    assert len(weights.chunks) == 4
    # cut 10 bytes into the third chunk: the two whole ones are kept, nothing is at the target
    _, held = uploads.receive_chunks(staging, root, weights.path, 0, io.BytesIO(data[:2 * size + 10]).read)
    assert held == 2 * size and B.partial_upload(root, weights.sha256).stat().st_size == held
    assert not target.exists()
    assert B.arrived_bytes(manifest, root, [weights]) == {weights.sha256: held}
    # from further than what is held, or off a chunk boundary: refused, the partial unchanged
    for offset in (3 * size, size + 1):
        with pytest.raises(B.BundleError, match="resume from"):
            uploads.receive_chunks(staging, root, weights.path, offset, lambda n: b"")
    # a chunk that is not the manifest's: refused before it is written
    wrong = bytearray(data[held:])
    wrong[5] ^= 0xFF
    with pytest.raises(B.BundleError, match="chunk 2 .* does not hash as the signed manifest lists"):
        uploads.receive_chunks(staging, root, weights.path, held, io.BytesIO(bytes(wrong)).read)
    assert B.resume_point(root, weights, size) == held
    # the rest from there: the whole file, checked, moves to its staged path
    _, whole = uploads.receive_chunks(staging, root, weights.path, held, io.BytesIO(data[held:]).read)
    assert whole == weights.size and target.read_bytes() == data
    assert not B.partial_upload(root, weights.sha256).exists()


def test_a_damaged_or_torn_partial_is_cut_back_to_its_last_good_chunk_or_dropped(chunked):
    manifest, root, staging, weights, data = chunked
    size, partial = manifest.chunk_size, B.partial_upload(root, weights.sha256)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:3 * size] + os.urandom(100))  # a torn write after three good chunks
    assert B.resume_point(root, weights, size) == 3 * size and partial.stat().st_size == 3 * size
    damaged = bytearray(data[:3 * size])
    damaged[size + 7] ^= 0xFF  # the second chunk damaged in place
    partial.write_bytes(bytes(damaged))
    assert B.resume_point(root, weights, size) == size and partial.read_bytes() == data[:size]
    partial.write_bytes(b"x" + data[1:size])
    assert B.resume_point(root, weights, size) == 0 and not partial.exists()
    assert B.arrived_bytes(manifest, root, [weights]) == {}


def test_chunks_pushed_as_files_are_absorbed_in_order_and_a_torn_one_dropped(chunked):
    manifest, root, staging, weights, data = chunked
    size, folder = manifest.chunk_size, root / B.RESUME
    folder.mkdir(parents=True)
    for k in (0, 1):
        (folder / f"{weights.sha256}.{k}").write_bytes(data[k * size:(k + 1) * size])
    (folder / f"{weights.sha256}.2").write_bytes(data[2 * size:2 * size + 99])  # cut mid-push
    (folder / f"{weights.sha256}.3").write_bytes(data[3 * size:])  # after a gap: not used
    assert uploads.absorb_chunks(staging, root, check=True) == {weights.sha256: 2 * size}
    assert sorted(p.name for p in folder.iterdir()) == [weights.sha256]
    for k in (2, 3):
        (folder / f"{weights.sha256}.{k}").write_bytes(data[k * size:(k + 1) * size])
    assert uploads.absorb_chunks(staging, root) == {weights.sha256: weights.size}
    assert (staging / "files" / weights.path).read_bytes() == data and not list(folder.iterdir())
    # the rest staged whole, and an upload of one of them cut off earlier: installing drops it
    bundle = staging.parent.parent.parent / "chunked"
    for f in manifest.files:
        if f.sha256 != weights.sha256:
            (staging / "files" / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(bundle / "files" / f.path, staging / "files" / f.path)
    other = min(manifest.files, key=lambda f: f.size)
    B.partial_upload(root, other.sha256).write_bytes(b"cut")
    assert B.install_bundle(staging, root).build_id == "c1"
    assert not list(folder.iterdir())


def test_chunks_are_checked_against_a_manifest_signed_with_the_farm_key(chunked, tmp_path):
    manifest, root, staging, weights, data = chunked
    rogue = B.generate_keypair(tmp_path / "rogue.key", tmp_path / "rogue.pub")
    (staging / B.SIGNATURE).write_bytes(rogue.sign(manifest.canonical_bytes()))
    with pytest.raises(B.BundleError, match="manifest signature does not verify"):
        uploads.receive_chunks(staging, root, weights.path, 0, io.BytesIO(data).read)
    with pytest.raises(B.BundleError, match="manifest signature does not verify"):
        uploads.absorb_chunks(staging, root)
    assert not B.partial_upload(root, weights.sha256).exists()


def test_partial_bundle_without_the_store_refused(bundle, keys, tmp_path):
    partial = partial_copy(bundle, tmp_path / "partial", {"engine/__init__.py"})
    root = tmp_path / "agent"
    with pytest.raises(B.BundleError, match=r"files/agent/run.sh: not in the bundle and not in the device's store"):
        B.install_bundle(partial, root, keys[1])
    assert store_entries(root) == [] and B.current_build(root) is None


def test_corrupt_store_blob_refused_for_absent_file(bundle, keys, tmp_path):
    root = tmp_path / "agent"
    m = B.install_bundle(bundle, root, keys[1]).manifest
    shutil.rmtree(root / "builds/b1")  # force a fresh tree
    entry = next(f for f in m.files if f.path == "profiles/adreno.json")
    blob = B.blob_path(root, entry.sha256)
    os.chmod(blob, 0o644)
    blob.write_text('{"match": {"vendor": "evil!!!!"}}'[: entry.size].ljust(entry.size))
    partial = partial_copy(bundle, tmp_path / "partial", {f.path for f in m.files} - {entry.path})
    with pytest.raises(B.BundleError, match=r"files/profiles/adreno.json \(store blob .*\): sha256 mismatch"):
        B.install_bundle(partial, root, keys[1])
    # a full bundle repairs the damaged blob
    B.install_bundle(bundle, root, keys[1])
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == entry.sha256


def test_interrupted_copy_leaves_no_partial_blob(bundle, keys, src, tmp_path, monkeypatch):
    root = tmp_path / "agent"
    B.install_bundle(bundle, root, keys[1])
    (src / "engine/ops/conv2d.py").write_text("v2\n")
    (src / "model/unet/new.safetensors").write_bytes(os.urandom(100_000))
    build(src, tmp_path / "b2", keys[0], build_id="b2")
    calls = []
    real_copy = files.copy_hashing

    def dying_copy(source, target, fsync=False):
        calls.append(target)
        if len(calls) == 2:  # the second blob: half written, then the disk "fills"
            with open(target, "xb") as f:
                f.write(Path(source).read_bytes()[:1000])
            raise OSError(28, "No space left on device")
        return real_copy(source, target, fsync)

    monkeypatch.setattr(B, "copy_hashing", dying_copy)
    with pytest.raises(OSError, match="No space left"):
        B.install_bundle(tmp_path / "b2", root, keys[1])
    monkeypatch.undo()
    for blob in store_entries(root):
        assert not blob.name.startswith("."), f"temporary left behind: {blob}"
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    assert B.current_build(root).build_id == "b1"
    assert not (root / "builds/b2").exists()
    assert B.install_bundle(tmp_path / "b2", root, keys[1]).build_id == "b2"


def test_interrupted_tree_leaves_current_unchanged(bundle, keys, src, tmp_path, monkeypatch):
    root = tmp_path / "agent"
    B.install_bundle(bundle, root, keys[1])
    (src / "engine/ops/conv2d.py").write_text("v2\n")
    build(src, tmp_path / "b2", keys[0], build_id="b2")
    calls = []

    def dying_link(blob, target):
        calls.append(target)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the agent killed while linking
        return os.link(blob, target) is None

    monkeypatch.setattr(B, "_try_link", dying_link)
    with pytest.raises(KeyboardInterrupt):
        B.install_bundle(tmp_path / "b2", root, keys[1])
    assert B.current_build(root).build_id == "b1"
    assert sorted(p.name for p in (root / "builds").iterdir()) == ["b1", "current"]
    monkeypatch.undo()
    assert B.install_bundle(tmp_path / "b2", root, keys[1]).build_id == "b2"


def test_stale_temporaries_are_swept(bundle, keys, tmp_path):
    root = tmp_path / "agent"
    b = B.install_bundle(bundle, root, keys[1])
    shard = B.blob_path(root, b.manifest.files[0].sha256).parent
    (shard / ".tmp-deadbeef-1").write_bytes(b"half")  # what a killed agent leaves
    (root / "builds/.tmp-b9-1").mkdir()
    B.install_bundle(bundle, root, keys[1])
    assert not (shard / ".tmp-deadbeef-1").exists() and not (root / "builds/.tmp-b9-1").exists()


# ---- damage after install, downgrades ----------------------------------------------------------


def _damage_in_place(path: Path) -> None:
    """Flip one byte of a file, keeping its size: what a bad disk block or a stray write does."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_store_blob_damaged_in_place_is_missing_found_by_verify_and_repaired(bundle, keys, tmp_path):
    root = tmp_path / "agent"
    installed = B.install_bundle(bundle, root, keys[1])
    assert B.missing_files(installed.manifest, root) == [] and B.verify_build(root, installed) == []
    weights = next(f for f in installed.manifest.files if f.path.endswith("diffusion_pytorch_model.safetensors"))
    _damage_in_place(B.blob_path(root, weights.sha256))
    # compared by size, the damaged blob was held and never sent again
    assert [f.sha256 for f in B.missing_files(installed.manifest, root)] == [weights.sha256]
    # the tree shares the blob's inode: both paths of that blob are damaged, nothing else
    assert sorted(B.verify_build(root, installed)) == ["models/tiny/unet/copy.safetensors",
                                                       "models/tiny/unet/diffusion_pytorch_model.safetensors"]
    # a re-deploy sends just that file, and the install repairs the blob and the tree
    partial = partial_copy(bundle, tmp_path / "repair", {weights.path})
    repaired = B.install_bundle(partial, root, keys[1])
    assert B.verify_build(root, repaired) == [] and B.missing_files(installed.manifest, root) == []
    assert hashlib.sha256((repaired.path / weights.path).read_bytes()).hexdigest() == weights.sha256


def test_the_hash_cache_hashes_an_unchanged_file_once_and_a_rewritten_one_again(bundle, keys, tmp_path, monkeypatch):
    root = tmp_path / "agent"
    installed = B.install_bundle(bundle, root, keys[1])
    B.verify_build(root, installed)  # fills the cache
    hashed = []
    real = B.sha256_file
    monkeypatch.setattr(B, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    assert B.verify_build(root, installed) == [] and hashed == []
    profile = next(f for f in installed.manifest.files if f.path == "profiles/adreno.json")
    target = installed.path / profile.path
    os.chmod(target, 0o644)
    target.write_bytes(target.read_bytes())  # the same bytes, written again: hashed again, still intact
    assert B.verify_build(root, installed) == [] and hashed == ["adreno.json"]
    _damage_in_place(target)
    assert B.verify_build(root, installed) == ["profiles/adreno.json"]
    (root / B.HashCache.NAME).write_text("not json")  # a broken cache costs a re-hash, never a wrong answer
    assert B.verify_build(root, installed) == ["profiles/adreno.json"]


def test_a_run_of_a_damaged_build_fails_naming_the_file(bundle, keys, tmp_path):
    from agent.jobs import run_job
    from agent.protocol import JobSpec

    root = tmp_path / "agent"
    installed = B.install_bundle(bundle, root, keys[1])
    _damage_in_place(installed.path / "shaders/conv2d/winograd.wgsl")
    spec = JobSpec(job_id="damaged-1", kind="generate", model="models/tiny", time_limit_s=60.0)
    result = run_job(spec, tmp_path / "out", root)
    assert result.status == "failed"
    assert "build b1 is damaged on this device: shaders/conv2d/winograd.wgsl" in result.error
    assert "deploy the build again" in result.error


def test_an_older_build_is_installed_beside_the_current_one_unless_downgrades_are_allowed(keys, src, tmp_path):
    old = build(src, tmp_path / "old", keys[0], build_id="old")
    (src / "engine/ops/conv2d.py").write_text("def conv2d():\n    return 3\n")
    new = build(src, tmp_path / "new", keys[0], build_id="new")
    assert old.created < new.created
    root = tmp_path / "agent"
    assert B.install_bundle(tmp_path / "new", root, keys[1]).kept_current is None
    beside = B.install_bundle(tmp_path / "old", root, keys[1])
    assert beside.kept_current == "new" and B.current_build(root).build_id == "new"
    assert {b.build_id for b in B.list_builds(root)} == {"old", "new"}  # jobs naming "old" still run it
    assert B.install_bundle(tmp_path / "old", root, keys[1], allow_downgrade=True).kept_current is None
    assert B.current_build(root).build_id == "old"
    assert B.install_bundle(tmp_path / "new", root, keys[1]).kept_current is None  # upgrades need nothing
    assert B.current_build(root).build_id == "new"
