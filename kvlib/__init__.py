"""kvlib: the KV caches of the course, the token loop that runs any of them (the contract:
:mod:`kvlib.contract`), the models, and the instruments that measure them.

Shapes are written in one axis legend, here and in every shape comment:

    B  batch (sequences)          n    new tokens in one forward
    L  layers                     Hq   query heads
    S  slots: cache length, or    Hkv  KV heads (Hq / Hkv query heads share one)
       the context attended to    D    head_dim
    V  vocabulary                 d    hidden size"""

from .cat_cache import CatCache
from .contract import Cache
from .decoder import forward
from .env import auto_dtype, default_device, label
from .kv_cache import KVCache
from .latent_cache import LatentCache
from .loop import Generation, generate
from .meter import AllocMeter, MeteredCache
from .models import load_model, model_names
from .quant_cache import QuantCache
from .ring_cache import RingCache

__all__ = ["AllocMeter", "Cache", "CatCache", "Generation", "KVCache", "LatentCache",
           "MeteredCache", "QuantCache", "RingCache", "auto_dtype", "default_device", "forward",
           "generate", "label", "load_model", "model_names"]
