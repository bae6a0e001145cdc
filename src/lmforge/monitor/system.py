"""Background sampling of the machine a rank runs on: CPU, memory, disk, network, its GPU.

`SystemSampler(interval_s)` samples in a daemon thread; `latest()` returns the newest
sample. Keys (all floats; a key is absent when it cannot be measured here, GPU keys on CPU):

| key | meaning |
|---|---|
| sys_cpu_percent | system-wide CPU use, 0-100 |
| sys_process_cpu_percent | this process, percent of one core (can exceed 100) |
| sys_children_cpu_percent | child processes (DataLoader workers, compile workers), same unit |
| sys_process_rss_gb / sys_children_rss_gb | resident memory, GB (10^9 bytes) |
| sys_mem_used_gb / sys_mem_available_gb / sys_mem_percent | system memory, GB and percent |
| sys_disk_read_mb_s / sys_disk_write_mb_s | all disks, MB/s (10^6 bytes) since the last sample |
| sys_net_sent_mb_s / sys_net_recv_mb_s | all NICs, MB/s since the last sample |
| sys_gpu_util_percent / sys_gpu_mem_util_percent | this rank's GPU busy and memory-busy time (NVML) |
| sys_gpu_mem_used_gb / sys_gpu_mem_total_gb | this rank's GPU memory in use by all processes, and its size |
| sys_gpu_temp_c / sys_gpu_power_w | temperature and power draw (NVML) |
| sys_gpu_mem_allocated_gb / sys_gpu_mem_reserved_gb | torch's caching allocator on this rank's GPU |

The GPU is `device` (default: LOCAL_RANK, else 0), a torch index mapped through
CUDA_VISIBLE_DEVICES to NVML. The sampler never initialises CUDA itself: torch memory
stats are read only once the training code has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any

import psutil

log = logging.getLogger(__name__)
GB = 1e9  # decimal, as train/numerics.py's rss_gb and gpu_mem_*_gb
MB = 1e6

SYSTEM_KEYS: tuple[str, ...] = (
    "sys_cpu_percent",
    "sys_process_cpu_percent",
    "sys_children_cpu_percent",
    "sys_process_rss_gb",
    "sys_children_rss_gb",
    "sys_mem_used_gb",
    "sys_mem_available_gb",
    "sys_mem_percent",
    "sys_disk_read_mb_s",
    "sys_disk_write_mb_s",
    "sys_net_sent_mb_s",
    "sys_net_recv_mb_s",
    "sys_gpu_util_percent",
    "sys_gpu_mem_util_percent",
    "sys_gpu_mem_used_gb",
    "sys_gpu_mem_total_gb",
    "sys_gpu_temp_c",
    "sys_gpu_power_w",
    "sys_gpu_mem_allocated_gb",
    "sys_gpu_mem_reserved_gb",
)


class SystemSampler:
    """Samples every `interval_s` seconds in a daemon thread until `stop()`."""

    def __init__(self, interval_s: float, device: int | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.device = device if device is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
        self._process = psutil.Process()
        self._children: dict[int, psutil.Process] = {}
        self._latest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_io: tuple[float, Any, Any] | None = None
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self._nvml_tried = False

    def start(self) -> SystemSampler:
        """Prime the rate counters and start sampling in the background."""
        if self._thread is None:
            self.sample()  # first CPU percentages are meaningless; rates need a previous reading
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="lmforge-system-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (returns within one sample) and release NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(self.interval_s, 5.0))
            self._thread = None
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = self._nvml_handle = None
            self._nvml_tried = False

    def latest(self) -> dict[str, float]:
        """The newest sample (a copy); empty before the first."""
        with self._lock:
            return dict(self._latest)

    def sample(self) -> dict[str, float]:
        """Take one sample now (also what the thread calls) and make it the latest."""
        values: dict[str, float] = {}
        for part in (self._cpu_and_memory, self._io_rates, self._gpu):
            try:
                values.update(part())
            except Exception as err:  # a sampler never takes training down
                log.debug("system sample %s failed: %s", part.__name__, err)
        with self._lock:
            self._latest = values
        return dict(values)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _cpu_and_memory(self) -> dict[str, float]:
        proc = self._process
        with proc.oneshot():
            values = {
                "sys_cpu_percent": psutil.cpu_percent(interval=None),
                "sys_process_cpu_percent": proc.cpu_percent(interval=None),
                "sys_process_rss_gb": proc.memory_info().rss / GB,
            }
        child_cpu = child_rss = 0.0
        alive: dict[int, psutil.Process] = {}
        for child in proc.children(recursive=True):
            known = self._children.get(child.pid, child)  # cpu_percent needs the same object across samples
            try:
                child_cpu += known.cpu_percent(interval=None)
                child_rss += known.memory_info().rss
                alive[child.pid] = known
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self._children = alive
        values["sys_children_cpu_percent"] = child_cpu
        values["sys_children_rss_gb"] = child_rss / GB
        memory = psutil.virtual_memory()
        values["sys_mem_used_gb"] = (memory.total - memory.available) / GB
        values["sys_mem_available_gb"] = memory.available / GB
        values["sys_mem_percent"] = float(memory.percent)
        return values

    def _io_rates(self) -> dict[str, float]:
        now, disk, net = time.monotonic(), psutil.disk_io_counters(), psutil.net_io_counters()
        previous, self._last_io = self._last_io, (now, disk, net)
        if previous is None or now <= previous[0]:
            return {}
        then, old_disk, old_net = previous
        dt = now - then
        values = {}
        if disk is not None and old_disk is not None:  # containers may have no disk counters
            values["sys_disk_read_mb_s"] = max(disk.read_bytes - old_disk.read_bytes, 0) / dt / MB
            values["sys_disk_write_mb_s"] = max(disk.write_bytes - old_disk.write_bytes, 0) / dt / MB
        if net is not None and old_net is not None:
            values["sys_net_sent_mb_s"] = max(net.bytes_sent - old_net.bytes_sent, 0) / dt / MB
            values["sys_net_recv_mb_s"] = max(net.bytes_recv - old_net.bytes_recv, 0) / dt / MB
        return values

    def _gpu(self) -> dict[str, float]:
        values = self._torch_gpu()
        handle = self._nvml_device()
        if handle is not None:
            nvml = self._nvml
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            values["sys_gpu_util_percent"] = float(util.gpu)
            values["sys_gpu_mem_util_percent"] = float(util.memory)
            values["sys_gpu_mem_used_gb"] = memory.used / GB
            values["sys_gpu_mem_total_gb"] = memory.total / GB
            for key, read, scale in (
                (
                    "sys_gpu_temp_c",
                    lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                    1.0,
                ),
                ("sys_gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle), 1e-3),  # milliwatts
            ):
                with contextlib.suppress(Exception):  # not every board reports every sensor
                    values[key] = float(read()) * scale
        return values

    def _torch_gpu(self) -> dict[str, float]:
        torch = sys.modules.get("torch")  # never import torch (or initialise CUDA) just to sample
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        if self.device >= torch.cuda.device_count():
            return {}
        values = {
            "sys_gpu_mem_allocated_gb": torch.cuda.memory_allocated(self.device) / GB,
            "sys_gpu_mem_reserved_gb": torch.cuda.memory_reserved(self.device) / GB,
        }
        if self._nvml_device() is None:  # without NVML, CUDA's own view of the device memory
            free, total = torch.cuda.mem_get_info(self.device)
            values["sys_gpu_mem_used_gb"] = (total - free) / GB
            values["sys_gpu_mem_total_gb"] = total / GB
        return values

    def _nvml_device(self) -> Any:
        """NVML handle of this rank's GPU, or None (no pynvml / nvidia-ml-py, no driver, no GPU)."""
        if self._nvml_tried:
            return self._nvml_handle
        self._nvml_tried = True
        try:
            import pynvml  # from the nvidia-ml-py package
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:
            return None
        self._nvml = pynvml
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
            if entries and self.device < len(entries):
                entry = entries[self.device]
                if entry.isdigit():
                    self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
                else:  # GPU-... / MIG-... UUIDs
                    self._nvml_handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
            elif self.device < pynvml.nvmlDeviceGetCount():
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(self.device)
        except Exception as err:
            log.debug("NVML has no device %d: %s", self.device, err)
            self._nvml_handle = None
        return self._nvml_handle
