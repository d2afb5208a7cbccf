"""kvlib: the final code of the KV-cache course.

The notebooks in ``notebooks/`` build each piece and then import it from here: the preallocated
:class:`KVCache` and the ``cat`` baseline it replaces, the token loop that runs either one, the models,
and the instruments that measure them.
"""

from .cat_cache import CatCache
from .env import auto_dtype, default_device, label
from .decoder import forward
from .generate import Generation, generate
from .kv_cache import KVCache
from .meter import AllocMeter, MeteredCache
from .models import load_model, model_names

__all__ = ["AllocMeter", "CatCache", "Generation", "KVCache", "MeteredCache", "auto_dtype", "default_device",
           "forward", "generate", "label", "load_model", "model_names"]
