"""Building, caching and loading the compiled kernels (``src/*.c``), one library per instruction
set, and finding out which of them this CPU can run.

Each variant is compiled with its own fixed flags (never ``-march=native``), so a library's
instructions depend only on its variant: ``c`` (the compiler's baseline for the machine: any
CPU of its architecture), ``avx2`` (AVX2 and FMA), ``avx512`` (those and AVX-512 F, BW, VL, DQ
and VNNI). The cache key covers the sources, the
generated header, the flags and the compiler's own version text; a variant is loaded only
where ``hbfp_cpu_features`` (run from the ``c`` build, which any CPU of the architecture can
execute) reports what it needs, so a cache shared between machines never runs an instruction
a CPU lacks.

The cache (``$HBFP_CACHE``, else ``~/.cache/hbfp``) is checked before anything of it runs: a
library's file name carries the SHA-256 of its content, which is verified on every load; a file
that is not a regular file owned by this user, or that others may write (or in a directory
others may write), is not loaded but rebuilt. The verified bytes are what is loaded (through a
memory file on Linux, so the file cannot change between the check and the load). The compiler
runs under a time limit (``$HBFP_CC_TIMEOUT`` seconds, default 180). ``HBFP_NATIVE=0`` turns
the compiled kernels off; ``HBFP_KERNELS=c`` (a comma-separated list of variants) allows only
those.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import capi

__all__ = ["Variant", "VARIANTS", "FEATURES", "load", "features", "why", "cache_dir", "library_path"]

SRC = Path(__file__).with_name("src")
SOURCES = ("pool.c", "cpu.c", "quantize.c", "dequantize.c", "conv.c", "gemm.c", "cell.c")
HEADERS = ("common.h",)

#: The bits ``hbfp_cpu_features`` reports (src/cpu.c).
FEATURES = {"avx2": 1, "avx512": 2, "amx": 4}

_COMMON = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-math-errno",
           "-fvisibility=hidden", "-Wall")


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name, the compiler flags beyond the common ones, and the
    feature bits the CPU must report to run it (0: any CPU of the architecture)."""

    name: str
    flags: tuple[str, ...]
    needs: int


#: Fastest first. "c": portable C (the compiler vectorizes it for the architecture's baseline).
VARIANTS = (
    Variant("avx512", ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
            FEATURES["avx512"] | FEATURES["avx2"]),
    Variant("avx2", ("-mavx2", "-mfma"), FEATURES["avx2"]),
    Variant("c", (), 0),
)

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("HBFP_CACHE") or Path.home() / ".cache" / "hbfp")


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _timeout() -> float:
    try:
        return float(os.environ.get("HBFP_CC_TIMEOUT", "180"))
    except ValueError:
        raise OSError(f"HBFP_CC_TIMEOUT must be a number of seconds, got {os.environ['HBFP_CC_TIMEOUT']!r}") from None


def _compiler_identity(cc: str) -> bytes:
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, timeout=min(30.0, _timeout()))
        return r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        raise OSError(f"{cc} --version took more than {min(30.0, _timeout()):g} s (HBFP_CC_TIMEOUT)") from None
    except OSError as e:
        raise OSError(f"no C compiler ({cc!r}: {e}; set CC)") from None


_openmp_ok: dict[str, bool] = {}


def _openmp(cc: str) -> tuple[str, ...]:
    """``-fopenmp`` where the compiler builds with it (and ``HBFP_OPENMP`` is not 0): the
    kernels' parallel parts then run on the OpenMP runtime the process has (torch's, whose
    threads would otherwise spin beside the kernels' own); else the kernels' own pool
    (src/pool.c)."""
    if os.environ.get("HBFP_OPENMP", "1") == "0":
        return ()
    if cc not in _openmp_ok:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "t.c"
            src.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
            try:
                r = subprocess.run([cc, "-fopenmp", "-shared", "-fPIC", "-o", str(Path(tmp) / "t.so"), str(src)],
                                   capture_output=True, timeout=_timeout())
                _openmp_ok[cc] = r.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                _openmp_ok[cc] = False
    return ("-fopenmp",) if _openmp_ok[cc] else ()


def _flags(variant: Variant, cc: str) -> tuple[str, ...]:
    return _COMMON + _openmp(cc) + variant.flags


def _key(variant: Variant, cc: str) -> str:
    h = hashlib.sha256()
    parts = [capi.header().encode(), capi.vector_source().encode(), cc.encode(), _compiler_identity(cc),
             " ".join(_flags(variant, cc)).encode(), os.uname().machine.encode()]
    parts += [(SRC / f).read_bytes() for f in SOURCES + HEADERS]
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()[:20]


def library_path(variant: str) -> Path | None:
    """The verified cached library of ``variant`` (None if there is none)."""
    v = _variant(variant)
    found = _find(v, _key(v, _compiler()))
    return found[0] if found else None


def _variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"no kernel variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def _safe_dir(d: Path) -> str | None:
    """Why ``d`` may not hold libraries we load (None: it may)."""
    try:
        st = os.lstat(d)
    except OSError as e:
        return f"{d}: {e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{d} is not owned by this user"
    if st.st_mode & 0o022:
        return f"{d} may be written by other users"
    return None


def _verified(path: Path) -> bytes | None:
    """The content of a cached library if it passes every check, else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    want = path.stem.rsplit("-", 1)[-1]
    return data if hashlib.sha256(data).hexdigest()[:16] == want else None


def _find(v: Variant, key: str) -> tuple[Path, bytes] | None:
    d = cache_dir()
    if _safe_dir(d) is not None:
        return None
    for p in sorted(glob.glob(str(d / f"hbfp-kernels-{v.name}-{key}-*.so"))):
        data = _verified(Path(p))
        if data is not None:
            return Path(p), data
        try:  # a file that fails a check is never loaded: out of the way of the rebuild
            os.unlink(p)
        except OSError:
            pass
    return None


def _build(v: Variant, key: str, cc: str) -> tuple[Path, bytes]:
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    bad = _safe_dir(d)
    if bad is not None:
        raise OSError(f"cannot use the kernel cache: {bad} (set HBFP_CACHE to a directory of your own)")
    timeout = _timeout()
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        (Path(tmp) / "hbfp_abi.h").write_text(capi.header())
        (Path(tmp) / "hbfp_abi.c").write_text(capi.vector_source())
        out = Path(tmp) / "lib.so"
        cmd = [cc, *_flags(v, cc), f"-I{tmp}", f"-I{SRC}", "-o", str(out), *(str(SRC / f) for f in SOURCES),
               str(Path(tmp) / "hbfp_abi.c"), "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise OSError(f"{cc} took more than {timeout:g} s on the {v.name} kernels (HBFP_CC_TIMEOUT)") from None
        except OSError as e:
            raise OSError(f"no C compiler ({cc!r}: {e}; set CC)") from None
        if r.returncode != 0:
            raise OSError(f"{cc} failed on the {v.name} kernels: {r.stderr.strip()[-2000:]}")
        data = out.read_bytes()
        final = d / f"hbfp-kernels-{v.name}-{key}-{hashlib.sha256(data).hexdigest()[:16]}.so"
        os.chmod(out, 0o700)
        os.replace(out, final)  # atomic: processes that build at once never see half a file
    return final, data


def _dlopen(path: Path, data: bytes) -> ctypes.CDLL:
    """Loads exactly ``data`` (verified): from a memory file where the OS has them, so the file
    on disk cannot be swapped between the check and the load."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        # The descriptor stays open: the dynamic loader knows a library by its path, and a
        # reused descriptor number would give the next variant this one's handle.
        fd = os.memfd_create(f"hbfp-kernels-{path.stem}", 0)
        os.write(fd, data)
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    return ctypes.CDLL(str(path))


def _open(v: Variant) -> ctypes.CDLL:
    if os.environ.get("HBFP_NATIVE", "1") == "0":
        raise OSError("turned off by HBFP_NATIVE=0")
    cc = _compiler()
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} is not on PATH; set CC)")
    key = _key(v, cc)
    found = _find(v, key)
    path, data = found if found is not None else _build(v, key, cc)
    lib = _dlopen(path, data)
    capi.declare(lib)
    if lib.hbfp_abi() != capi.ABI or lib.hbfp_isa().decode() != v.name:
        raise OSError(f"{path} reports ABI {lib.hbfp_abi()} and ISA {lib.hbfp_isa().decode()!r}, expected "
                      f"{capi.ABI} and {v.name!r}")
    return lib


def _load_variant(name: str) -> ctypes.CDLL | None:
    if name in _libs:
        return _libs[name]
    with _lock:
        if name in _libs:
            return _libs[name]
        v = _variant(name)
        lib = None
        try:
            allowed = os.environ.get("HBFP_KERNELS")
            if allowed and name not in {a.strip() for a in allowed.split(",")}:
                raise OSError(f"not among HBFP_KERNELS={allowed}")
            if v.needs:
                base = _load_variant_locked("c")
                if base is None:
                    raise OSError(f"the portable build is not available ({_why.get('c')})")
                have = base.hbfp_cpu_features()
                if have & v.needs != v.needs:
                    raise OSError(f"this CPU (or its OS) lacks {v.name}")
            lib = _open(v)
        except OSError as e:
            _why[name] = str(e)
        _libs[name] = lib
        return lib


def _load_variant_locked(name: str) -> ctypes.CDLL | None:
    if name in _libs:
        return _libs[name]
    v = _variant(name)
    lib = None
    try:
        lib = _open(v)
    except OSError as e:
        _why[name] = str(e)
    _libs[name] = lib
    return lib


def load(name: str) -> ctypes.CDLL | None:
    """The library of variant ``name`` (built on first use), or None where it cannot run here
    (``why(name)`` says why)."""
    return _load_variant(name)


def why(name: str) -> str | None:
    """Why variant ``name`` is not available (None when it is)."""
    load(name)
    return _why.get(name)


def features() -> set[str]:
    """The instruction sets this CPU and its OS let the kernels use (empty without the
    portable build)."""
    base = load("c")
    if base is None:
        return set()
    bits = base.hbfp_cpu_features()
    return {name for name, bit in FEATURES.items() if bits & bit}
