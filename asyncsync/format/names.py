"""Names and paths of the protocol: constants, dtypes, version directories, file names."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncsync.errors import ConfigError, ManifestError

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "asyncsync"
FORMAT_VERSION = 3  # what this asyncsync writes
# what it reads: 2 added tensors in parts (multi-rank publish), 3 self-describing delta shards
# that a receiver may apply before the manifest (streaming; FORMAT.md section 4.3)
READ_FORMAT_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
LOG_NAME = "log.jsonl"
ACKS_DIR = "acks"
LEASES_DIR = "leases"  # engine-id leases (FORMAT.md section 7.1)
ROOT_INFO_NAME = "asyncsync.json"
# the delta encodings a manifest may name (asyncsync.codec implements them; docs/CODEC.md)
ENCODINGS: tuple[str, ...] = ("xef", "indices", "deltas", "deltas_zstd")
DEFAULT_ENCODING = "xef"
VERSION_DIGITS = 12
MAX_VERSION = 10**VERSION_DIGITS - 1
# A tensor name is 1 to MAX_NAME_CHARS characters and never the key safetensors reserves for
# its header metadata: a shard could not hold a tensor of that name (FORMAT.md section 3).
MAX_NAME_CHARS = 4096
SAFETENSORS_METADATA = "__metadata__"
# The largest integer our JSON may hold (all are exact doubles, < 2^53) and the most dimensions
# a tensor entry may have: every reader and the multi-rank merge hold shapes to both.
MAX_INT = 2**53 - 1
MAX_RANK = 64
# The largest shard a reader accepts (FORMAT.md section 3): a claim above it is refused by
# validation, before a reader allocates anything for it.
MAX_SHARD_BYTES = (1 << 40) - 1

# ASCII digits, and \Z, not $ (which also matches before a final newline: "v000000000005\n",
# a directory a hostile writer can make, read as version 5; \d matches any script's digits)
_VERSION_DIR_RE = re.compile(rf"^v([0-9]{{{VERSION_DIGITS}}})\Z")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_HEX_RE = re.compile(r"^[0-9a-f]{8,128}\Z")

# The dtypes a manifest may name: every dtype that both torch and safetensors name, with its
# size in bytes and its safetensors code (FORMAT.md section 11.5). The torch dtypes (DTYPES)
# are built on first use: reading a root (the CLIs, the lease) never imports torch.
_FORMAT_DTYPES: dict[str, tuple[int, str]] = {
    "bool": (1, "BOOL"),
    "uint8": (1, "U8"),
    "int8": (1, "I8"),
    "int16": (2, "I16"),
    "int32": (4, "I32"),
    "int64": (8, "I64"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float32": (4, "F32"),
    "float64": (8, "F64"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    # since helper-68 (an older reader refuses a manifest naming one: an unknown dtype)
    "uint16": (2, "U16"),
    "uint32": (4, "U32"),
    "uint64": (8, "U64"),
    "float8_e4m3fnuz": (1, "F8_E4M3FNUZ"),
    "float8_e5m2fnuz": (1, "F8_E5M2FNUZ"),
    "float8_e8m0fnu": (1, "F8_E8M0"),
    "complex64": (8, "C64"),
}
DTYPE_SIZES: dict[str, int] = {n: size for n, (size, _) in _FORMAT_DTYPES.items()}
SAFETENSORS_CODES: dict[str, str] = {n: code for n, (_, code) in _FORMAT_DTYPES.items()}
#: the dtypes torch names that the format does not carry, and why (for the error)
_NOT_CARRIED = {
    "complex128": "safetensors has no code for it (publish torch.view_as_real(t))",
    "complex32": "safetensors has no code for it (publish torch.view_as_real(t))",
    "float4_e2m1fn_x2": "two values per byte, which safetensors' F4 counts as two elements "
    "(publish its uint8 view)",
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    # float8_e8m0fnu came with torch 2.7: an older torch reads no tensor of it
    return {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_dtypes().items()}


def carried_dtypes() -> frozenset[torch.dtype]:
    """The torch dtypes the format carries (those of DTYPE_SIZES the installed torch has)."""
    return frozenset(_dtype_names())


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # {name: torch.dtype}, imported on first use
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def not_carried(dtype: torch.dtype) -> str:
    """Why the format does not carry ``dtype``, and the list it carries (for an error)."""
    name = str(dtype).removeprefix("torch.")
    why = _NOT_CARRIED.get(name) or (
        "a quantized dtype (publish its int_repr() and its scales)" if name.startswith("q")
        else "a bit-packed dtype (publish its uint8 view)" if name.startswith("bits")
        else "a sub-byte dtype (publish its packed uint8 view)" if re.fullmatch(r"u?int[1-7]", name)
        else "safetensors has no code for it"
    )  # fmt: skip
    return f"{why}; supported: {', '.join(DTYPE_SIZES)}"


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _dtype_names()[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} is not supported: {not_carried(dtype)}") from None


def check_dtype_name(name: object) -> str:
    """A dtype name a manifest may carry (no torch needed)."""
    if not isinstance(name, str) or name not in DTYPE_SIZES:
        raise ManifestError(f"unknown dtype {name!r}; supported: {', '.join(DTYPE_SIZES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _torch_dtypes()[check_dtype_name(name)]
    except KeyError:
        import torch

        raise ManifestError(
            f"dtype {name!r} is not known to the installed torch {torch.__version__}: "
            "upgrade torch on this host (float8_e8m0fnu needs torch 2.7 or later)"
        ) from None


# --------------------------------------------------------------------------- paths


def version_dir_name(version: int) -> str:
    if not 0 <= version <= MAX_VERSION:
        raise ManifestError(f"version {version} out of range 0..{MAX_VERSION}")
    return f"v{version:0{VERSION_DIGITS}d}"


def version_dir(root: Path, version: int) -> Path:
    return root / version_dir_name(version)


def manifest_path(root: Path, version: int) -> Path:
    return version_dir(root, version) / MANIFEST_NAME


def parse_version_dir(name: str) -> int | None:
    """The version a directory name stands for, or None when it is not a version directory."""
    m = _VERSION_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def check_file_name(name: object, what: str = "file name") -> str:
    """A plain file name: no separator, no leading dot, no ``..``: it cannot leave its directory."""
    if not isinstance(name, str) or not _FILE_RE.match(name) or ".." in name:
        raise ManifestError(
            f"unsafe or invalid {what} {name!r}: expected [A-Za-z0-9][A-Za-z0-9._-]*"
        )
    return name


def check_engine_id(engine_id: object) -> str:
    if not isinstance(engine_id, str) or not _ENGINE_ID_RE.match(engine_id) or ".." in engine_id:
        raise ManifestError(
            f"invalid engine id {engine_id!r}: use 1-128 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return engine_id


def ack_path(root: Path, engine_id: str) -> Path:
    return root / ACKS_DIR / f"{check_engine_id(engine_id)}.json"


def root_path(root: object) -> Path:
    """``Path(root)`` for a root given to a constructor; ConfigError for anything but a
    non-empty ``str`` or ``os.PathLike`` of one (``Path("")`` is the working directory: an
    unset variable, never a choice)."""
    try:
        text = os.fspath(root)  # type: ignore[call-overload]
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise ConfigError(f"root must be a non-empty path, got {root!r}")
    return Path(text)
