"""Which CPU a figure came from: model name, instruction-set level, threads, torch.

Timings differ by machine kind more than by anything layerplan does (a bf16 matrix product on 8
rows costs about one row on an AVX-512 BF16 CPU and eight rows on an AVX2-only one), so `bench`
and `tune` print this line and store it with their results.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path


# instruction-set levels, best first: (label, /proc/cpuinfo flags that must all be present)
ISA_LEVELS = (
    ("AMX", ("amx_tile", "amx_bf16")),
    ("AVX-512 BF16", ("avx512f", "avx512_bf16")),
    ("AVX-512", ("avx512f",)),
    ("AVX2", ("avx2",)),
)


@dataclass(frozen=True)
class CpuInfo:
    model: str  # e.g. "AMD EPYC 7B13" ("unknown CPU" where the OS does not say)
    isa: str  # best of AMX / AVX-512 BF16 / AVX-512 / AVX2 the CPU reports, else "below AVX2" or "unknown"
    torch_capability: str | None  # the kernels torch dispatches to (ATEN_CPU_CAPABILITY can lower it)
    threads: int  # torch's intra-op threads (the native kernels' threads in a process without torch)
    cores: int  # logical CPUs the OS reports
    torch: str | None  # None: timed in a process without torch, on the native kernels alone
    kernels: str | None = None  # the native kernels' build, where torch's is not there to name

    def line(self) -> str:
        if self.torch is None:
            return (f"CPU: {self.model}, {self.isa} (native kernels {self.kernels}), "
                    f"{self.threads} threads of {self.cores}")
        return (f"CPU: {self.model}, {self.isa} (torch kernels {self.torch_capability}), "
                f"{self.threads} threads of {self.cores}, torch {self.torch}")

    def to_dict(self) -> dict:
        return asdict(self)


def isa_level(flags: set[str] | None) -> str:
    if flags is None:
        return "unknown"
    for label, needed in ISA_LEVELS:
        if all(flag in flags for flag in needed):
            return label
    return "below AVX2"


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> tuple[str | None, set[str] | None]:
    """(model name, flags) of the first processor in /proc/cpuinfo; None where absent (not Linux)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None, None
    model, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
        if model is not None and flags is not None:
            break
    return model, flags


def physical_cores(cpuinfo: str | Path = "/proc/cpuinfo") -> int:
    """The physical cores among the CPUs this process may run on (each core once, however many
    hardware threads it has): torch's default number of threads, which the light front end takes
    too. Where /proc/cpuinfo does not say, the CPUs this process may run on."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return max(len(allowed), 1)
    cores, processor, package = set(), None, "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            processor = int(value) if value.isdigit() else None
        elif key == "physical id":
            package = value
        elif key == "core id" and processor in allowed:
            cores.add((package, value))
    return max(len(cores) or len(allowed), 1)


def kernels_cpu_info(threads: int, kernels: str, cpuinfo: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """The CPU of figures a process without torch timed on the native kernels alone (the light
    front end's probe and bench): its line names the kernels' build where torch's would be."""
    model, flags = read_cpuinfo(cpuinfo)
    return CpuInfo(model=model or platform.processor() or "unknown CPU", isa=isa_level(flags), torch_capability=None,
                   threads=threads, cores=os.cpu_count() or 0, torch=None, kernels=kernels)


def cpu_info(cpuinfo: str | Path = "/proc/cpuinfo") -> CpuInfo:
    import torch  # here: read_cpuinfo is read by processes without torch (layerplan/lite/)

    model, flags = read_cpuinfo(cpuinfo)
    return CpuInfo(
        model=model or platform.processor() or "unknown CPU",
        isa=isa_level(flags),
        torch_capability=str(torch.backends.cpu.get_cpu_capability()),
        threads=torch.get_num_threads(),
        cores=os.cpu_count() or 0,
        torch=torch.__version__,
    )
