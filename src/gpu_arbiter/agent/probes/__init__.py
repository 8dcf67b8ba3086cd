"""GPU probes: one interface (:class:`Probe`), several implementations.

::

    probe = await detect() or FakeProbe.from_spec("2x24G:sm_86")
    snapshot = await probe.snapshot()          # never blocks the loop, never raises
    gpus = to_gpus(snapshot, "box-1")          # core Gpu specs (headroom 256 MiB)
    probes = to_gpu_probes(snapshot, {"lease-1": [pid]})   # core GpuProbe per index
    stale = snapshot.stale_indices             # GPUs that failed: no grants there

=============  ===========================================================
``nvml``       :class:`NvmlProbe`, NVML through ``nvidia-ml-py`` (first)
``nvidia-smi`` :class:`NvidiaSmiProbe`, CSV queries (fallback)
``rocm-smi``   :class:`RocmSmiProbe`, AMD, JSON output
``fake:SPEC``  :class:`FakeProbe`, GPUs declared by ``2x24G:sm_86`` or a file
=============  ===========================================================
"""

from ._detect import PROBE_NAMES, detect, open_probe
from ._fake import (
    FAKE_USAGE_DIR_ENV,
    FakeGpu,
    FakeProbe,
    load_fake_file,
    parse_fake_spec,
    process_alive,
    report_usage,
)
from ._nvidia_smi import (
    APPS_FIELDS,
    GPU_FIELDS,
    NvidiaSmiProbe,
    ParsedGpus,
    nvidia_smi_snapshot,
    parse_compute_apps,
    parse_query_gpu,
)
from ._nvml import NvmlProbe, load_nvml
from ._rocm_smi import ROCM_SMI_ARGS, RocmSmiProbe, parse_rocm_smi
from ._snapshot import (
    DEFAULT_HEADROOM_MB,
    GpuFailure,
    GpuReading,
    KnownGpus,
    Probe,
    ProbeSnapshot,
    ProbeUnavailable,
    to_gpu_probes,
    to_gpus,
)

__all__ = [
    "APPS_FIELDS",
    "DEFAULT_HEADROOM_MB",
    "FAKE_USAGE_DIR_ENV",
    "GPU_FIELDS",
    "PROBE_NAMES",
    "ROCM_SMI_ARGS",
    "FakeGpu",
    "FakeProbe",
    "GpuFailure",
    "GpuReading",
    "KnownGpus",
    "NvidiaSmiProbe",
    "NvmlProbe",
    "ParsedGpus",
    "Probe",
    "ProbeSnapshot",
    "ProbeUnavailable",
    "RocmSmiProbe",
    "detect",
    "load_fake_file",
    "load_nvml",
    "nvidia_smi_snapshot",
    "open_probe",
    "parse_compute_apps",
    "parse_fake_spec",
    "parse_query_gpu",
    "parse_rocm_smi",
    "process_alive",
    "report_usage",
    "to_gpu_probes",
    "to_gpus",
]
