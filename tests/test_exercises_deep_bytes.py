"""The deep dive's exercise check, and the wrong answers it must catch."""

import torch
from exercises import deep_bytes
from helpers import check_tests

from kvlib.config import kv_bytes_per_token, load_config


def _heads(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def mla_doubled(config, dtype, context):  # MLA priced as K and V: twice the latent
    return (2 if hasattr(config, "kv_lora_rank") else 1) * deep_bytes.bytes_per_token_solution(
        config, dtype, context)


def window_ignored(config, dtype, context):  # every layer grows forever
    if rank := getattr(config, "kv_lora_rank", None):
        return config.num_hidden_layers * (rank + config.qk_rope_head_dim) * dtype.itemsize
    return (2 * config.num_hidden_layers * config.num_key_value_heads * _heads(config)
            * dtype.itemsize)


def query_heads(config, dtype, context):  # K and V per query head: MHA's price for everyone
    if hasattr(config, "kv_lora_rank"):
        return deep_bytes.bytes_per_token_solution(config, dtype, context)
    return (2 * config.num_hidden_layers * config.num_attention_heads * _heads(config)
            * dtype.itemsize)


def with_kvlib(config, dtype, context):  # kvlib's own pricing: the check hides it
    return kv_bytes_per_token(config, dtype, context=context)


CASES = [(deep_bytes.check_bytes_per_token, deep_bytes.bytes_per_token_solution,
          [mla_doubled, window_ignored, query_heads])]
test_check = check_tests(deep_bytes, CASES)


def test_kvlibs_pricing_is_hidden(capsys):
    deep_bytes.check_bytes_per_token(with_kvlib)
    assert "`kv_bytes_per_token`" in capsys.readouterr().out


def test_the_solution_is_kvlibs_price():
    """The reference solution agrees with kvlib on every shipped format (so the check is right)."""
    for name in deep_bytes.FORMATS:
        config = load_config(name)
        for context in (10, 1_024, 50_000):
            assert deep_bytes.bytes_per_token_solution(config, torch.bfloat16, context) == \
                kv_bytes_per_token(config, torch.bfloat16, context=context)
