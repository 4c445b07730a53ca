"""Importing vLLM for the adapter: in-process, on the supported version only, and on a
CPU machine whose torchvision wheel was built for CUDA.

PyPI's torchvision wheels are CUDA builds. Against CPU torch their C extension does not
load, and torchvision then fails at import (`operator torchvision::nms does not exist`)
where it registers fake kernels for two operators of that extension. vLLM's Qwen3.5 model
imports transformers' image processors, which import torchvision, so `import vllm`'s
Qwen3.5 path fails. `load_torchvision` defines those two operators' schemas (no kernels:
nothing here runs them) when, and only when, the extension did not load; nothing inside
an installed package is edited. vLLM inspects a model's class in a subprocess of its own
(`python -m vllm.model_executor.models.registry`); that subprocess goes through
`worker_client.engine_vllm.inspect` instead, which does the same first.

OpenMP threads on a CPU. vLLM's multiprocess executor starts its model process with the
OpenMP settings of `VLLM_CPU_OMP_THREADS_BIND` (so many threads, bound to those CPUs); an
in-process engine core (the worker's) gets none, and OpenMP then runs a team of one thread
per CPU of the machine, unbound, in every thread that steps the model. `omp_settings`
gives the worker's process the settings vLLM gives its model process; they must be in the
environment before torch is imported (OpenMP reads them once, as it loads).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from importlib import metadata

from . import SUPPORTED_VLLM_VERSION


class VllmUnavailable(RuntimeError):
    """vLLM is missing or is not the supported version: one line that says what to do."""


def installed_vllm_version() -> str | None:
    """The version of the installed vLLM distribution (`vllm` or `vllm-cpu`), or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(version: str | None) -> None:
    """Raise VllmUnavailable unless `version` is the supported one."""
    if version is None:
        raise VllmUnavailable(
            f"--engine vllm needs vLLM {SUPPORTED_VLLM_VERSION}, which is not installed in "
            f"this environment: run scripts/setup.sh --engine vllm and start the worker "
            f"with .venv-vllm/bin/lattice-worker"
        )
    if version.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise VllmUnavailable(
            f"--engine vllm supports vLLM {SUPPORTED_VLLM_VERSION} only (its scheduler "
            f"hooks are private and change between releases); this environment has "
            f"{version}: run scripts/setup.sh --engine vllm"
        )


@functools.cache
def _operator_schemas():
    """The two torchvision operators torchvision registers fake kernels for, defined
    without kernels; kept for the life of the process (a Library unregisters when freed)."""
    import torch

    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return library


def define_missing_torchvision_ops() -> None:
    """Define the two schemas now if torchvision is installed and its C extension does not
    load, before anything imports torchvision (a process that cannot wrap the import:
    vLLM's spawned engine core, through `site/sitecustomize.py`)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import glob

    import torch

    for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(path)
        except OSError:
            _operator_schemas()


def load_torchvision() -> None:
    """Import torchvision, if installed, also when its C extension does not load."""
    try:
        importlib.import_module("torchvision")
    except ModuleNotFoundError:
        return  # not installed: transformers' text models do without it
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _operator_schemas()
        importlib.import_module("torchvision")


def prepare_vllm():
    """The `vllm` module, checked, with torchvision loaded as above (also in vLLM's
    model-inspection subprocess): for any use of vLLM in this environment."""
    check_version(installed_vllm_version())
    load_torchvision()
    vllm = importlib.import_module("vllm")
    registry = importlib.import_module("vllm.model_executor.models.registry")
    # vLLM documents this list as the command of its model-inspection subprocess.
    registry._SUBPROCESS_COMMAND = [sys.executable, "-m", "worker_client.engine_vllm.inspect"]
    return vllm


def omp_settings(environ: Mapping[str, str], cpu_build: bool) -> dict[str, str]:
    """The OpenMP variables to add to `environ` for an in-process vLLM, as vLLM's executor
    sets them for its model process on a CPU build (`cpu_build`): OMP_NUM_THREADS,
    OMP_PLACES and OMP_PROC_BIND from rank 0's CPUs in VLLM_CPU_OMP_THREADS_BIND ("0-3",
    "0,2|4-7": ranks apart by "|"). None for its "auto" and "nobind" (OpenMP's defaults
    stay), on a GPU build, or for a variable `environ` sets already (a person's choice)."""
    cpus = parse_cpu_ids(environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").split("|")[0])
    if not cpus or not cpu_build:
        return {}
    wanted = {
        "OMP_NUM_THREADS": str(len(cpus)),
        "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
        "OMP_PROC_BIND": "true",
    }
    return {name: value for name, value in wanted.items() if name not in environ}


def parse_cpu_ids(text: str) -> tuple[int, ...]:
    """CPU ids of a list such as "0-3,6" (() for "auto", "nobind" or anything else)."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return ()
        cpus += range(int(first), int(last or first) + 1)
    return tuple(cpus)


def set_omp_threads() -> dict[str, str]:
    """Put `omp_settings` into this process's environment (before torch is imported:
    afterwards OpenMP would not read them, and nothing is set); what was set."""
    if "torch" in sys.modules:
        return {}
    try:
        metadata.version("vllm-cpu")
        cpu_build = True
    except metadata.PackageNotFoundError:
        cpu_build = False
    settings = omp_settings(os.environ, cpu_build)
    os.environ.update(settings)
    return settings


@functools.cache
def import_vllm():
    """The `vllm` module, set up for an in-process engine (the worker steps vLLM's
    EngineCore itself: no engine-core subprocess)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return prepare_vllm()
