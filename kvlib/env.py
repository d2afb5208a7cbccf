"""Where a result was measured, in one line that travels with it: a number without its device,
dtype, cap, allocator settings and versions cannot be compared with anything."""

import os
import platform
from contextlib import suppress

import torch
import transformers

__all__ = ["allocator_settings", "auto_dtype", "default_device", "describe", "label", "resolve"]


def resolve(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, a bare ``"cuda"`` indexed: ``torch.cuda`` functions
    disagree about a device without an index (some read the current one, some raise)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def default_device() -> torch.device:
    """The current CUDA device, with its index, when there is one; else the CPU."""
    return resolve("cuda" if torch.cuda.is_available() else "cpu")


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on sm >= 8.0, fp16 on older CUDA, fp32 on the CPU (half precision is mostly slower
    there). Not ``is_bf16_supported()``: a T4 says True for an *emulated*, slow bf16."""
    device = torch.device(device)  # a bare "cuda" is fine here: torch reads the current card
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def allocator_settings(device: torch.device | str) -> dict:
    """What the CUDA caching allocator runs with, asked of it and of its live segments, not of the
    environment (a setting the platform cannot honour is not on). ``{}`` off CUDA."""
    device = resolve(device)
    if device.type != "cuda":
        return {}
    out: dict = {"backend": torch.cuda.memory.get_allocator_backend()}
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        out["config"] = torch._C._accelerator_getAllocatorSettings()
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        out["memory_fraction"] = torch.cuda.get_per_process_memory_fraction(device)
    segments = [s for s in torch.cuda.memory._snapshot()["segments"]
                if s.get("device", device.index) == device.index]
    if segments and "is_expandable" in segments[0]:
        out["expandable_segments"] = any(s["is_expandable"] for s in segments)
    elif "config" in out:
        config = out["config"].lower().replace(" ", "")
        out["expandable_segments"] = "expandable_segments:true" in config
    return out


def _cpu_model() -> str:
    with suppress(OSError), open("/proc/cpuinfo") as f:  # no such file: not Linux
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe(device: torch.device | str, dtype: torch.dtype | None = None, cap=None) -> dict:
    """Everything :func:`label` says, as a dict for JSON results; ``cap``: a ``memory.Cap``."""
    device = resolve(device)
    out: dict = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, total_memory=props.total_memory,
                   capability=f"{props.major}.{props.minor}", allocator=allocator_settings(device))
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        out.update(name=_cpu_model(), cores=cores)
    out.update(dtype=None if dtype is None else str(dtype).removeprefix("torch."),
               cap=None if cap is None else cap.note, torch=torch.__version__,
               transformers=transformers.__version__, python=platform.python_version())
    return out


def label(device: torch.device | str, dtype: torch.dtype | None = None, cap=None) -> str:
    """One line: hardware · cap · expandable segments (GPU only) · dtype · torch · transformers."""
    d = describe(device, dtype, cap)
    parts = [d["name"] if "capability" in d else f"CPU ({d['cores']} cores, {d['name']})"]
    if cap is not None and "capability" in d:
        parts.append(cap.label)
    if (on := d.get("allocator", {}).get("expandable_segments")) is not None:
        parts.append(f"expandable segments {'on' if on else 'off'}")
    if d["dtype"]:
        parts.append(d["dtype"])
    return " · ".join(parts + [f"torch {d['torch']}", f"transformers {d['transformers']}"])
