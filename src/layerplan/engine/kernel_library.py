"""The native kernels as a shared library: its ABI read from kernels/kernels.h, built once per ISA
(and sources, compiler and flags) with the system C compiler, picked from the CPU's flags, loaded
and checked.

One library per instruction set (ISAS, best first), like ggml-cpu's per-ISA builds: each compiles
the shared kernel files with its flags and its own product file. A CPU gets the best one whose
flags it has; LAYERPLAN_KERNEL_ISA names one instead ("generic", the portable C build, runs
anywhere a C compiler does). The checks at load, each failing with one line:
- the ABI: the library's LP_ABI_VERSION and its structs' sizes and field offsets, as its compiler
  laid them out, equal what this module computed from kernels.h;
- OpenMP: the library's OpenMP calls resolve to the runtime torch already loaded (two runtimes in
  one process each start their own threads, and fight over the cores);
- sanitizers: a library built with LAYERPLAN_SANITIZE=1 loads only into a process started with
  the sanitizer runtime preloaded (`make test-sanitize`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import re
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from layerplan.files import cache_dir, write_json_atomic
from layerplan.machine import read_cpuinfo

KERNELS = Path(__file__).with_name("kernels")
HEADER = KERNELS / "kernels.h"


class NativeUnavailable(RuntimeError):
    """The native kernels cannot run here (CPU without AVX2/FMA, no C compiler); says which."""


class AbiMismatch(RuntimeError):
    """The library and kernels.h disagree (a stale build, or a header native.py misread): a bug,
    never a reason to fall back to eager quietly."""


# ----- the ABI, read from kernels.h ----------------------------------------------------------------

_SCALARS = {"long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
            "char": ctypes.c_char, "unsigned char": ctypes.c_ubyte}


@dataclass(frozen=True)
class Abi:
    """kernels.h as ctypes: its integer constants (LP_...), structs and function signatures."""

    constants: dict[str, int]
    structs: dict[str, type[ctypes.Structure]]
    functions: dict[str, tuple[object, list]]  # name -> (restype, argtypes)

    def __getattr__(self, name: str):
        try:
            return self.constants[name]
        except KeyError:
            raise AttributeError(name) from None

    def layout(self) -> str:
        """The structs' sizes and field offsets in lp_abi_layout's format."""
        return ";".join(f"{name} {ctypes.sizeof(struct)}"
                        + "".join(f" {field} {getattr(struct, field).offset}" for field, _ in struct._fields_)
                        for name, struct in self.structs.items())


def _ctype(declaration: str, structs: dict, *, result: bool = False):
    """The ctypes type of a C type as kernels.h writes them ('const lp_norm *', 'long', ...)."""
    text = declaration.replace("const", " ").replace("*", " * ")
    stars = text.count("*")
    base = " ".join(text.replace("*", " ").split())
    if stars == 0:
        if base == "void":
            return None
        if base in _SCALARS:
            return _SCALARS[base]
        if base in structs:
            return structs[base]
    elif stars == 1 and base in structs:
        return ctypes.POINTER(structs[base])
    elif stars == 1 and base == "char" and result:
        return ctypes.c_char_p
    elif stars == 1 and (base in _SCALARS or base == "void"):
        return ctypes.c_void_p
    elif stars == 2:
        return ctypes.POINTER(ctypes.c_void_p)
    raise AbiMismatch(f"kernels.h: native.py does not read the C type '{declaration.strip()}'")


def _split_declaration(text: str) -> tuple[str, str]:
    """'const lp_norm *nm' -> ('const lp_norm *', 'nm')."""
    match = re.fullmatch(r"(.*?[\s*])(\w+)", " ".join(text.split()))
    if not match:
        raise AbiMismatch(f"kernels.h: native.py does not read the declaration '{text.strip()}'")
    return match.group(1), match.group(2)


def read_abi(text: str) -> Abi:
    """Parses the subset of C that kernels.h keeps to (see its first comment)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    constants = {name: int(value) for name, value in re.findall(r"^\s*#define\s+(LP_\w+)\s+(-?\d+)\s*$", text, re.M)}
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    structs: dict[str, type[ctypes.Structure]] = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", code, re.S):
        fields = []
        for declaration in filter(None, (part.strip() for part in body.split(";"))):
            if "," in declaration or "[" in declaration or "(" in declaration:
                raise AbiMismatch(f"kernels.h: one plain field per declaration, not '{declaration}' (in {name})")
            ctype, field = _split_declaration(declaration)
            fields.append((field, _ctype(ctype, structs)))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    functions = {}
    for result, name, parameters in re.findall(r"\bLP_API\s+([\w\s*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", code):
        arguments = []
        if parameters.strip() != "void":
            for parameter in parameters.split(","):
                arguments.append(_ctype(_split_declaration(parameter)[0], structs))
        functions[name] = (_ctype(result, structs, result=True), arguments)
    if "LP_ABI_VERSION" not in constants or not structs or not functions:
        raise AbiMismatch("kernels.h: no LP_ABI_VERSION, structs or LP_API functions found")
    return Abi(constants, structs, functions)


ABI = read_abi(HEADER.read_text())
# the architecture table's facts (models/arch_table.py: an activation's function, KernelLayout.norm)
# as the kernels' ABI names them
ACTIVATION_CODES = {"silu": ABI.LP_ACT_SILU, "gelu_tanh": ABI.LP_ACT_GELU_TANH}
NORM_ROUNDING = {"llama": ABI.LP_NORM_ROUND_NORMALISED, "gemma": ABI.LP_NORM_ROUND_PRODUCT}


# ----- which library: ISA, compiler, flags ---------------------------------------------------------

@dataclass(frozen=True)
class Isa:
    name: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags it needs
    flags: tuple[str, ...]  # compiler flags
    products: tuple[str, ...]  # its product files in kernels/, each named for the ISA it is written for


# Best first. Each library compiles the shared files (every .c in kernels/ but products_*.c) and its
# row's product files: products_<isa>.c (fp32, bf16), products_quant_<isa>.c (the block formats'
# exact tiles) and products_int_<isa>.c (their integer tiles, LP_ARITH_INT8; the generic build has
# none). "avx512vnni" is where the CPU has AVX-512 BW, VL, VNNI and VBMI (Ice Lake, Sapphire Rapids,
# Zen 4): AVX2's exact tiles, and integer tiles on vpdpbusd and 64-byte words, which give the same
# integers as AVX2's vpmaddubsw route. An AVX-512 build of the fp32 tiles would be a
# products_avx512.c in its row (and an AVX-512 branch of simd.h).
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
ISAS = (
    Isa("avx512vnni", frozenset({"avx2", "fma", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}),
        _AVX2 + ("-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi"),
        ("products_avx2.c", "products_quant_avx2.c", "products_int_avx512vnni.c")),
    Isa("avx2", frozenset({"avx2", "fma"}), _AVX2, ("products_avx2.c", "products_quant_avx2.c", "products_int_avx2.c")),
)
# only when LAYERPLAN_KERNEL_ISA asks for it
PORTABLE = Isa("generic", frozenset(), (), ("products_generic.c", "products_quant_generic.c"))

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fvisibility=hidden")
# Functions and loops start on 64-byte lines, so where the hot loops fall (which moves pass times)
# does not change with every edit of the source. GCC takes them, as does clang from version 13; a
# compiler that refuses them builds the kernels without.
ALIGN_FLAGS = ("-falign-functions=64", "-falign-loops=64")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
LIBS = ("-lm", "-ldl")
COMPILERS_FILE = "compilers.json"  # each compiler file's --version line, by its identity (_compiler_identity)
_PRODUCTS = re.compile(r"products_\w+\.c")  # the product files, which go to the libraries their ISAS rows name


def sources(isa: Isa) -> list[Path]:
    """The shared files, then the ISA's product files."""
    return (sorted(p for p in KERNELS.glob("*.c") if not _PRODUCTS.fullmatch(p.name))
            + [KERNELS / name for name in isa.products])


def choose_isa() -> Isa:
    """The library for this CPU: LAYERPLAN_KERNEL_ISA's, else the best of ISAS the CPU has."""
    asked = os.environ.get("LAYERPLAN_KERNEL_ISA")
    known = {isa.name: isa for isa in (*ISAS, PORTABLE)}
    if asked:
        if asked not in known:
            raise NativeUnavailable(f"LAYERPLAN_KERNEL_ISA={asked}: the kernels are built for {', '.join(known)}")
        return known[asked]
    model, flags = read_cpuinfo()
    for isa in ISAS:
        if isa.cpu_flags <= (flags or set()):
            return isa
    missing = sorted(ISAS[-1].cpu_flags - (flags or set()))
    raise NativeUnavailable(f"the native engine needs AVX2 and FMA; this CPU ({model or 'unknown'}) lacks "
                            f"{', '.join(missing)}: use --engine eager (or LAYERPLAN_KERNEL_ISA=generic for the "
                            "portable kernels)")


def sanitizing() -> bool:
    return os.environ.get("LAYERPLAN_SANITIZE", "") not in ("", "0")


def build_flags(isa: Isa) -> tuple[str, ...]:
    """The flags of this process's build (before ALIGN_FLAGS): the ISA's, LAYERPLAN_SANITIZE's and
    LAYERPLAN_KERNEL_FLAGS' (appended last, so they override)."""
    return (FLAGS + isa.flags + (SANITIZE_FLAGS if sanitizing() else ())
            + tuple(shlex.split(os.environ.get("LAYERPLAN_KERNEL_FLAGS", ""))))


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("the native engine needs a C compiler (cc, gcc or clang) on PATH; "
                            "use --engine eager, or install gcc")


@lru_cache(maxsize=8)
def _compiler_identity(compiler: str) -> str:
    """The compiler's path and the first line of its --version: another compiler behind the same
    name builds another library. Kept in the cache folder by the compiler file's identity (real
    path, size, modification time, inode), so a start asks the compiler only once it changed."""
    path = shutil.which(compiler) or compiler
    try:
        real = os.path.realpath(path)
        status = os.stat(real)
        stamp = f"{real} {status.st_size} {status.st_mtime_ns} {status.st_ino}"
    except OSError:
        stamp = None
    kept_file = _cache_folder() / COMPILERS_FILE
    try:
        kept = json.loads(kept_file.read_text())
    except (OSError, ValueError):
        kept = {}
    if stamp is not None and isinstance(kept, dict) and isinstance(kept.get(stamp), str):
        return f"{path} {kept[stamp]}"
    import subprocess  # (here: only a compiler not seen before is asked; a start imports it for nothing else)

    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        version = (done.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        return f"{path} "
    if stamp is not None and done.returncode == 0:
        try:
            write_json_atomic(kept_file, {**(kept if isinstance(kept, dict) else {}), stamp: version})
        except OSError:  # (a read-only cache: asked again next time)
            pass
    return f"{path} {version}"


def kernels_key(compiler: str | None = None, isa: Isa | None = None) -> str:
    """Changes with the kernels' sources, the ISA, the flags or the compiler: a build or a timing of
    other kernels is not reused."""
    try:
        compiler = compiler or _compiler()
    except NativeUnavailable:
        compiler = "none"
    try:
        isa = isa or choose_isa()
    except NativeUnavailable:
        isa = PORTABLE
    digest = hashlib.sha256()
    for path in sorted(KERNELS.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join((_compiler_identity(compiler), isa.name) + build_flags(isa) + ALIGN_FLAGS).encode())
    return digest.hexdigest()[:16]


def _cache_folder() -> Path:
    return cache_dir() / "native"


def build(isa: Isa, compiler: str, folder: Path | None = None) -> Path:
    """The library for `isa`, compiled once per kernels_key: one process builds while the others
    that want the same library wait for it (a lock file beside it), each source compiled on a
    thread of its own (the product files take most of the time), then linked, and moved in
    whole (atomic)."""
    folder = folder or _cache_folder()
    tag = "-sanitize" if sanitizing() else ""
    target = folder / f"kernels-{isa.name}{tag}-{kernels_key(compiler, isa)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not target.exists():  # (else another process built it while this one waited)
            with tempfile.TemporaryDirectory(dir=folder, prefix=".kernels-") as work:
                staging = Path(work) / target.name
                for flags in (build_flags(isa) + ALIGN_FLAGS, build_flags(isa)):
                    error = _compile_and_link(compiler, flags, sources(isa), Path(work), staging)
                    if error is None:
                        break
                if error is not None:
                    raise NativeUnavailable(f"building the native kernels ({isa.name}) with {compiler} failed: "
                                            f"{error}")
                os.replace(staging, target)
    (folder / f".{target.name}.lock").unlink(missing_ok=True)
    # builds unused for a week go (another install may still use a recent one)
    for old in folder.glob("kernels-*.so"):
        if old != target and time.time() - old.stat().st_atime > 7 * 86400:
            old.unlink(missing_ok=True)
    return target


def _compile_and_link(compiler: str, flags: tuple[str, ...], files: list[Path], work: Path, out: Path) -> str | None:
    """Each of `files` compiled to an object in `work`, as many at once as there are cores (the
    largest first), then all linked into `out`; None, or the compiler's last line of error."""
    # (here: a start that finds its library built imports neither)
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(item: tuple[int, Path]) -> tuple[Path, subprocess.CompletedProcess]:
        index, path = item
        obj = work / f"{index:03d}-{path.stem}.o"
        return obj, subprocess.run([compiler, *flags, "-c", str(path), "-o", str(obj)], capture_output=True,
                                   text=True)

    largest_first = sorted(enumerate(files), key=lambda item: -item[1].stat().st_size)
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1))) as pool:
        compiled = sorted(pool.map(compile_one, largest_first))
    runs = [done for _, done in compiled]
    if all(done.returncode == 0 for done in runs):
        runs = [subprocess.run([compiler, *flags, *(str(obj) for obj, _ in compiled), "-o", str(out), *LIBS],
                               capture_output=True, text=True)]
    failed = [done for done in runs if done.returncode != 0]
    return (failed[0].stderr.strip().splitlines() or ["no message"])[-1] if failed else None


# ----- loading and its checks ----------------------------------------------------------------------

_OPENMP = re.compile(r"lib(gomp|iomp5|omp)[-.\w]*\.so")


def mapped_libraries(pattern: re.Pattern) -> set[str]:
    """Real paths of the shared libraries this process has mapped whose names match (empty where
    /proc/self/maps cannot be read)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        path = line.split(maxsplit=5)[-1] if len(line.split(maxsplit=5)) == 6 else ""
        if path.startswith("/") and pattern.search(os.path.basename(path)):
            found.add(os.path.realpath(path))
    return found


def check_abi(lib: ctypes.CDLL, abi: Abi = ABI) -> None:
    """The library was built from the kernels.h this process read, and ctypes lays its structs out
    as the compiler did; else AbiMismatch, in one line."""
    version = lib.lp_abi_version()
    if version != abi.LP_ABI_VERSION:
        raise AbiMismatch(f"the native library reports ABI {version}, kernels.h says {abi.LP_ABI_VERSION}: "
                          f"a stale build; delete {_cache_folder()} and retry")
    size = lib.lp_abi_layout(None, 0)
    text = ctypes.create_string_buffer(size + 1)
    lib.lp_abi_layout(text, size + 1)
    theirs = {entry.split()[0]: entry.split()[1:] for entry in text.value.decode().split(";")}
    ours = {entry.split()[0]: entry.split()[1:] for entry in abi.layout().split(";")}
    for name in [*ours, *(name for name in theirs if name not in ours)]:  # the header's order: inner structs first
        if theirs.get(name) != ours.get(name):
            raise AbiMismatch(f"{name} is laid out as {' '.join(theirs.get(name, ['(absent)']))} in the library and "
                              f"{' '.join(ours.get(name, ['(absent)']))} in native.py's reading of kernels.h "
                              "(size, then each field's offset)")


def check_openmp(lib: ctypes.CDLL, before: set[str]) -> str:
    """The OpenMP runtime the library's calls resolve to, when it is the one already in the
    process (torch's); else NativeUnavailable naming both."""
    runtime = lib.lp_openmp_runtime().decode()
    real = os.path.realpath(runtime) if runtime else ""
    if before and real and real not in before:
        raise NativeUnavailable(f"the native kernels link the OpenMP runtime {runtime}, torch uses "
                                f"{', '.join(sorted(before))}: two runtimes in one process; use --engine eager")
    return real


def _load(path: Path, abi: Abi = ABI) -> ctypes.CDLL:
    if sanitizing() and not mapped_libraries(re.compile(r"libasan")):
        raise NativeUnavailable("LAYERPLAN_SANITIZE=1 builds kernels that load only into a process started with "
                                "the AddressSanitizer runtime first: LD_PRELOAD=$(cc -print-file-name=libasan.so) "
                                "(see `make test-sanitize`)")
    before = mapped_libraries(_OPENMP)
    lib = ctypes.CDLL(str(path))
    for name, (result, arguments) in abi.functions.items():
        function = getattr(lib, name, None)
        if function is None:
            raise AbiMismatch(f"the native library at {path} has no {name}, which kernels.h declares")
        function.restype, function.argtypes = result, arguments
    check_abi(lib, abi)
    lib.openmp_runtime = check_openmp(lib, before)
    lib.isa = lib.lp_isa().decode()
    return lib


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernels for this CPU, built on first use, checked at load."""
    isa = choose_isa()
    return _load(build(isa, _compiler()))


HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int):
    """An uninitialised uint8 numpy array of nbytes (rounded up to whole 2 MB pages), 2 MB-aligned
    and advised onto 2 MB pages (lp_advise_huge_pages) before anything touches it: where a model's
    packed weights live, as a pass streams them (benchmarks/product_pages.c: 4 KB pages cost a TLB
    miss every 64 cache lines and stop the prefetchers at every page). Mapped for it alone, not
    taken from the heap, whose freed memory may have been touched on 4 KB pages already (and is,
    once heap.py keep_freed_memory has asked the heap to keep large blocks)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # private and anonymous: untouched, and on 2 MB pages where asked (shared memory takes them only
    # where the system's shmem setting allows, usually never)
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mapping, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    out = raw[start:start + size]
    library().lp_advise_huge_pages(out.ctypes.data, size)
    return out


def native_available() -> str | None:
    """None when the native kernels can run here, else the reason they cannot."""
    try:
        library()
    except NativeUnavailable as error:
        return str(error)
    return None


STATUSES = {ABI.LP_E_SHAPE: "a shape the kernels do not take", ABI.LP_E_TOKEN: "a token id outside the vocabulary",
            ABI.LP_E_MEMORY: "out of memory", ABI.LP_E_CAPACITY: "positions past the end of the KV slot",
            ABI.LP_E_TYPE: "an unknown weight format or dtype"}


def check(status: int, what: str) -> None:
    """Raises for a kernel's failing status (LP_E_...), naming it."""
    if status == ABI.LP_E_MEMORY:
        raise MemoryError(f"{what}: the native kernels could not allocate their scratch")
    if status != ABI.LP_OK:
        raise RuntimeError(f"{what} refused its input (status {status}: {STATUSES.get(status, 'unknown')})")
