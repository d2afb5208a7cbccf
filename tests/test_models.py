"""load_model: the course's models load with no network, once, in the right dtype; the rest fails
fast."""

import copy
import os
import re
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvlib.models as models
from kvlib import auto_dtype, load_model, model_names
from kvlib.config import load_config

SMOL = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
            head_dim=64)


class NoDequantization:
    """Stands in for the Auto classes in kvlib.models: a load from the GGUF file fails the test."""

    def __init__(self, auto):
        self.auto = auto

    def from_pretrained(self, *args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError(f"dequantized the GGUF again: from_pretrained({args}, {kwargs})")
        return self.auto.from_pretrained(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.auto, name)


def forbid_dequantization(monkeypatch):
    monkeypatch.setattr(models, "AutoModelForCausalLM", NoDequantization(AutoModelForCausalLM))
    monkeypatch.setattr(models, "AutoTokenizer", NoDequantization(AutoTokenizer))


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_smollm2_loads_offline_fp32_eval_with_a_chat_tokenizer(smollm2):
    model, tok = smollm2
    assert model.config.model_type == "llama"
    for key, value in SMOL.items():
        assert getattr(model.config, key) == value, key
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training and not any(m.training for m in model.modules())
    assert getattr(model, "hf_quantizer", None) is None  # plain weights, not a GGUF wrapper
    assert tok is not None and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = tok.decode(ids if isinstance(ids, list) else ids["input_ids"])
    assert "<|im_start|>assistant" in text
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_smollm2_second_load_reads_the_cache_and_does_not_dequantize(smollm2, monkeypatch):
    model, _ = smollm2  # the fixture's load made the cache, if it was not there
    assert (models._cache_dir() / "smollm2-135m" / "model.safetensors").is_file()
    forbid_dequantization(monkeypatch)
    again, tok = load_model("smollm2-135m", device="cpu")
    assert same_weights(again, model)
    assert tok.chat_template


@pytest.mark.skipif(
    os.environ.get("KVLIB_TEST_REBUILD") != "1",
    reason="dequantizes SmolLM2 again (~25 s of CPU); set KVLIB_TEST_REBUILD=1 to run it",
)
def test_smollm2_rebuilds_its_cache_in_a_fresh_folder(smollm2, tmp_path, monkeypatch, capfd):
    """The one slow test: dequantize into an empty $KVLIB_CACHE, quietly, to the same weights."""
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    capfd.readouterr()
    t0 = time.perf_counter()
    built, tok = load_model("smollm2-135m", device="cpu")
    first = time.perf_counter() - t0
    err = capfd.readouterr().err
    assert (tmp_path / "smollm2-135m" / "model.safetensors").is_file()
    # no half-written leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]
    assert tok.chat_template
    assert same_weights(built, smollm2[0])  # the same weights as the shared cache holds
    forbid_dequantization(monkeypatch)
    t0 = time.perf_counter()
    again, _ = load_model("smollm2-135m", device="cpu")
    assert same_weights(again, built) and time.perf_counter() - t0 < first
    # load_model turns progress bars off (no tqdm residue in notebook cells): the first load too
    assert "de-quantizing" not in err and "%|" not in err, err[-300:]


def test_random_model_has_the_real_config_and_no_tokenizer():
    model, tok = load_model("random:smollm2-135m", device="meta")  # full scale, no memory
    assert tok is None
    shipped = load_config("smollm2-135m")
    for key in SMOL:
        assert getattr(model.config, key) == getattr(shipped, key) == SMOL[key], key
    assert model.config.vocab_size == shipped.vocab_size == 49152
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32 and not model.training
    assert sum(p.numel() for p in model.parameters()) == 134515008


def test_random_weights_are_the_same_every_load(monkeypatch):
    """Seeded: the same noise every run. (2 layers: initialising 135M weights twice is slow.)"""
    small = load_config("smollm2-135m")
    small.num_hidden_layers, small.vocab_size = 2, 1024
    monkeypatch.setattr(models, "load_config", lambda name: copy.deepcopy(small))
    a, tok = load_model("random:smollm2-135m", device="cpu")
    torch.rand(100)  # whatever the global generator did in between
    b, _ = load_model("random:smollm2-135m", device="cpu")
    assert tok is None and a.config.num_hidden_layers == 2
    assert a.dtype == b.dtype == torch.float32  # dtype=None on the CPU: fp32
    assert same_weights(a, b)
    assert a.model.layers[0].self_attn.q_proj.weight.std() > 0  # really initialised, not zeros


def test_random_model_explicit_dtype_on_meta():
    model, _ = load_model("random:qwen3-4b", device="meta", dtype=torch.bfloat16)
    assert model.device.type == "meta" and model.dtype == torch.bfloat16
    c = model.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (36, 8, 128)


def test_auto_dtype_on_cpu_is_fp32():
    assert auto_dtype("cpu") == torch.float32
    assert auto_dtype(torch.device("meta")) == torch.float32


def test_model_names_lists_the_offline_choices():
    names = model_names()
    assert names[0] == "smollm2-135m"
    assert "random:qwen3-4b" in names and "random:smollm2-135m" in names


@pytest.mark.parametrize("name", ["nope", "smollm2", "qwen3-4b"])
def test_unknown_name_lists_the_choices(name):
    with pytest.raises(ValueError, match=re.escape(
            f"unknown model {name!r}; offline choices: {model_names()}")):
        load_model(name, device="meta")


HUB_ID = "Qwen/Qwen3-4B"


def hub_model_cached():
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(HUB_ID, "config.json"), str)


def assert_fails_fast_naming_the_offline_choices():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        load_model(HUB_ID, device="cpu")
    elapsed = time.perf_counter() - t0
    assert elapsed < 15, f"took {elapsed:.1f} s to say it is offline"
    msg = str(info.value)
    assert HUB_ID in msg and "not reachable" in msg
    for name in model_names():
        assert name in msg


def test_hub_id_offline_fails_fast(monkeypatch):
    if hub_model_cached():
        pytest.skip(f"{HUB_ID} is in the local Hugging Face cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hub_reachable",
                        lambda *a, **k: pytest.fail("probed the network while offline"))
    assert_fails_fast_naming_the_offline_choices()


def test_hub_id_with_the_real_network_check(monkeypatch):
    if hub_model_cached():
        pytest.skip(f"{HUB_ID} is in the local Hugging Face cache")
    if models._hub_reachable(timeout=3.0):
        pytest.skip("the hub is reachable here: this test is for a machine without it")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert_fails_fast_naming_the_offline_choices()


def test_hub_reachable_is_a_quick_false_for_an_unroutable_endpoint(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://nonexistent.invalid")
    t0 = time.perf_counter()
    assert models._hub_reachable(timeout=2.0) is False
    assert time.perf_counter() - t0 < 10
