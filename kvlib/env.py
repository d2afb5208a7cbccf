"""Where a result was measured, in one line that travels with it.

A number without its device, dtype, memory cap and library versions cannot be compared with anything, so
every figure and printed result carries :func:`label`. The dtype rule lives here too, because it is a
fact about the hardware: bf16 only where the card computes it natively.
"""

import os
import platform

import torch
import transformers

__all__ = ["auto_dtype", "default_device", "describe", "label"]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on compute capability >= 8.0 (Ampere on), fp16 on older CUDA, else fp32.

    Not ``torch.cuda.is_bf16_supported()``: on a T4 (7.5) it can answer True because bf16 is *emulated*,
    which runs but is slow and teaches the wrong speed. fp32 on CPU, where fp16/bf16 matmuls are mostly
    slower, not faster.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def describe(device: torch.device | str, dtype: torch.dtype | None = None, cap=None) -> dict:
    """Everything :func:`label` says, as a dict for JSON results. ``cap``: a ``memory.Cap``."""
    device = torch.device(device)
    out: dict = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, total_memory=props.total_memory,
                   capability=f"{props.major}.{props.minor}")
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        out.update(name=_cpu_model(), cores=cores)
    out.update(dtype=None if dtype is None else str(dtype).removeprefix("torch."),
               cap=None if cap is None else cap.note, torch=torch.__version__,
               transformers=transformers.__version__, python=platform.python_version())
    return out


def label(device: torch.device | str, dtype: torch.dtype | None = None, cap=None) -> str:
    """One line: hardware · cap (GPU only) · dtype · torch · transformers."""
    d = describe(device, dtype, cap)
    parts = [d["name"] if "capability" in d else f"CPU ({d['cores']} cores, {d['name']})"]
    if cap is not None and "capability" in d:
        parts.append(cap.label)
    if d["dtype"]:
        parts.append(d["dtype"])
    return " · ".join(parts + [f"torch {d['torch']}", f"transformers {d['transformers']}"])
