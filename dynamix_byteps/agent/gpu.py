"""GPU utilisation through NVML (``pynvml``, package ``nvidia-ml-py``), per worker process where NVML allows.

Without the NVML library or a driver (``NVMLError_LibraryNotFound``, ``NVMLError_DriverNotLoaded``,
or ``pynvml`` not installed) the monitor is unavailable: ``available`` is False, ``reason`` says
why (logged once, never retried), and :meth:`GpuMonitor.sample` returns all fields None. That is
logged at INFO on a host that shows no NVIDIA GPU (a CPU-only machine, where it is expected) and
as a WARNING where one shows (an NVIDIA device node or the driver's GPU list). No NVML error
escapes this module: a field NVML refuses (MIG, old GPUs, missing permissions) is None.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dynamix_byteps.extras import import_extra

log = logging.getLogger(__name__)

DEVICE_DIR = Path("/dev")  # the driver's device nodes: nvidia0, nvidia1, ...
DRIVER_GPUS_DIR = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver found


def _nvidia_gpu_visible() -> bool:
    """Whether this host shows an NVIDIA GPU: a device node ``/dev/nvidia<N>`` or an entry in the
    driver's ``/proc/driver/nvidia/gpus``."""
    return any(DEVICE_DIR.glob("nvidia[0-9]*")) or any(DRIVER_GPUS_DIR.glob("*"))


@dataclass(frozen=True)
class GpuStats:
    """GPU state seen by one process (None: unavailable or unknown).

    Attributes:
        available: NVML works on this host.
        reason: why fields are None (NVML missing, or the process has no GPU context), else None.
        device_index: NVML index of the GPU the process uses (the one with most of its memory).
        util: GPU busy fraction of that device over NVML's last sample period, 0-1.
        mem_used_bytes: memory used on that device, all processes, bytes.
        mem_total_bytes: memory of that device, bytes.
        sm_clock_mhz: current SM clock of that device, MHz.
        process_mem_used_bytes: GPU memory of this process on that device, bytes.
        process_sm_util: SM busy fraction attributed to this process since the previous sample, 0-1.
    """

    available: bool
    reason: str | None = None
    device_index: int | None = None
    util: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    sm_clock_mhz: int | None = None
    process_mem_used_bytes: int | None = None
    process_sm_util: float | None = None


@dataclass(frozen=True)
class _Device:
    index: int
    util: float | None
    mem_used: int | None
    mem_total: int | None
    sm_clock: int | None
    proc_mem: dict[int, int | None]  # pid -> bytes (None: NVML cannot say)
    proc_sm: dict[int, float]  # pid -> 0-1


class GpuMonitor:
    """NVML reader. ``sample(pids)`` never raises; check ``available``/``reason``."""

    def __init__(self) -> None:
        self.available = False
        self.reason: str = ""
        self._nvml = None
        self._handles: list = []
        self._last_ts: dict[int, int] = {}  # device -> NVML timestamp (µs) of the last process sample
        try:
            pynvml = import_extra("pynvml", "agent", "reading GPUs through NVML")
        except ImportError as e:
            self._unavailable(str(e))
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self._unavailable(f"NVML init failed: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a broken library must not stop the agent
            self._unavailable(f"NVML init failed: {type(e).__name__}: {e}")
            return
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as e:
            self._shutdown()
            self._unavailable(f"NVML device enumeration failed: {e}")
            return
        if not self._handles:
            self._shutdown()
            self._unavailable("NVML found no GPU")
            return
        self.available = True
        now_us = int(time.time() * 1e6)
        self._last_ts = {i: now_us for i in range(len(self._handles))}

    def _unavailable(self, reason: str) -> None:
        self.available = False
        self.reason = reason
        if _nvidia_gpu_visible():
            log.warning("gpu: unavailable (%s)", reason)
        else:
            log.info("gpu: unavailable (%s); this host shows no NVIDIA GPU", reason)

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as e:
                log.debug("gpu: nvmlShutdown: %s", e)
            self._nvml = None

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def _field(self, fn, *args):
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _read_device(self, index: int, handle) -> _Device:
        nv = self._nvml
        rates = self._field(nv.nvmlDeviceGetUtilizationRates, handle)
        mem = self._field(nv.nvmlDeviceGetMemoryInfo, handle)
        clock = self._field(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
        proc_mem: dict[int, int | None] = {}
        for getter in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
            for p in self._field(getter, handle) or []:
                used = getattr(p, "usedGpuMemory", None)
                prev = proc_mem.get(p.pid)
                proc_mem[p.pid] = used if prev is None else max(prev, used or 0)
        proc_sm: dict[int, float] = {}
        samples = self._field(nv.nvmlDeviceGetProcessUtilization, handle, self._last_ts.get(index, 0)) or []
        for s in samples:
            proc_sm[s.pid] = max(proc_sm.get(s.pid, 0.0), s.smUtil / 100.0)
            self._last_ts[index] = max(self._last_ts.get(index, 0), int(s.timeStamp))
        return _Device(
            index=index,
            util=rates.gpu / 100.0 if rates is not None else None,
            mem_used=int(mem.used) if mem is not None else None,
            mem_total=int(mem.total) if mem is not None else None,
            sm_clock=int(clock) if clock is not None else None,
            proc_mem=proc_mem,
            proc_sm=proc_sm,
        )

    def devices(self) -> list[GpuStats]:
        """Device-level stats of every GPU (empty when unavailable)."""
        if not self.available:
            return []
        try:
            devs = [self._read_device(i, h) for i, h in enumerate(self._handles)]
        except Exception as e:  # noqa: BLE001 - never let NVML stop the agent
            log.debug("gpu: device read failed: %s", e)
            return []
        return [GpuStats(True, None, d.index, d.util, d.mem_used, d.mem_total, d.sm_clock) for d in devs]

    def sample(self, pids: Iterable[int], device_of: Mapping[int, int] | None = None) -> dict[int, GpuStats]:
        """GPU stats for each pid.

        A pid is placed on the device whose NVML process list holds most of its memory; where
        NVML lists it nowhere (no context yet, or another pid namespace), ``device_of`` may
        name its device (for example from its CUDA_VISIBLE_DEVICES), else its fields are None.
        """
        pids = list(pids)
        if not self.available:
            return {pid: GpuStats(False, self.reason) for pid in pids}
        try:
            devs = [self._read_device(i, h) for i, h in enumerate(self._handles)]
        except Exception as e:  # noqa: BLE001 - never let NVML stop the agent
            return {pid: GpuStats(True, f"NVML read failed: {e}") for pid in pids}
        out: dict[int, GpuStats] = {}
        for pid in pids:
            on = [d for d in devs if pid in d.proc_mem or pid in d.proc_sm]
            if on:
                dev = max(on, key=lambda d: d.proc_mem.get(pid) or 0)
            elif device_of is not None and 0 <= device_of.get(pid, -1) < len(devs):
                dev = devs[device_of[pid]]
            else:
                out[pid] = GpuStats(True, "process has no GPU context NVML can see")
                continue
            out[pid] = GpuStats(
                available=True,
                reason=None,
                device_index=dev.index,
                util=dev.util,
                mem_used_bytes=dev.mem_used,
                mem_total_bytes=dev.mem_total,
                sm_clock_mhz=dev.sm_clock,
                process_mem_used_bytes=dev.proc_mem.get(pid),
                process_sm_util=dev.proc_sm.get(pid),
            )
        return out

    def close(self) -> None:
        self._shutdown()
        self._handles = []
        self.available = False
        if not self.reason:
            self.reason = "closed"
