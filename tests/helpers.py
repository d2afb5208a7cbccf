"""Helpers the tests import by name (conftest.py keeps fixtures and pytest's own setup).

Tiny random models of each family the token loop accepts: they run in milliseconds on a CPU but keep
what makes each family different: Llama with ``llama3`` RoPE scaling (its rotary embedding must come
from the model), Qwen2 with q/k/v biases and an untied head, Qwen3 with q/k norms, Mistral as Llama
under another name, Gemma with its scaled embedding, ``(1 + w)`` norms and GELU MLP, Helium with
interleaved RoPE, GLM rotating half of each head, Starcoder2 with biased LayerNorms and a plain MLP.
Weights are drawn with a large init so the logits are far apart and greedy decoding has no
near-ties.

The exercise checks' contract: every ``check_*`` of a notebook's ``exercises`` module is fed its
reference solution, a stub and known wrong answers, and must print one verdict for each.
"""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GlmConfig,
    HeliumConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Starcoder2Config,
)

SHARED = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)
TINY = {
    "llama": lambda: LlamaConfig(
        **SHARED, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: Qwen2Config(**SHARED, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**SHARED, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**SHARED, sliding_window=None, tie_word_embeddings=False),
    "gemma": lambda: GemmaConfig(**SHARED),
    "helium": lambda: HeliumConfig(**SHARED),
    "glm": lambda: GlmConfig(**SHARED),
    "starcoder2": lambda: Starcoder2Config(**SHARED),
}
FAMILIES = list(TINY)


def tiny_model(family: str, dtype=torch.float32, **overrides):
    config = TINY[family]()
    config.eos_token_id = None  # GLM's config fills in its own when given None
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the two largest logits: a greedy pick another arithmetic cannot move unless
    its logits are off by half of it."""
    top = logits.flatten().topk(2).values
    return (top[0] - top[1]).item()


def assert_same_greedy(tokens, logits, ref_tokens, ref_logits, **tolerance) -> int:
    """Greedy tokens as the reference's, except where a near-tie may fall either way.

    Another CPU adds in another order, and a step whose two best logits are closer than twice the
    error between the runs may pick either. Up to the first difference both runs share their
    history, so each step's logits are compared (to ``tolerance``, ``assert_close``'s); a
    difference is allowed only at such a near-tie, and ends the comparison (the histories part).
    Returns the number of steps with a shared history: ``len(ref_tokens)`` if none parted.
    """
    for step, (ours, theirs) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(ours, theirs, **tolerance,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        if tokens[step] != ref_tokens[step]:
            err, margin = (ours - theirs).abs().max().item(), top2_margin(theirs)
            assert margin <= 2 * err, (
                f"step {step}: token {tokens[step]}, the reference's {ref_tokens[step]}, where the "
                f"reference's top-2 margin {margin:.3g} exceeds twice the logit error {err:.3g}: "
                f"not a near-tie")
            return step
    assert len(tokens) == len(ref_tokens), (len(tokens), len(ref_tokens))
    return len(ref_tokens)


def stub(*args):
    raise NotImplementedError  # your code here


def assert_check_behaves(capsys, check, solution, wrongs, note=None):
    """Right for the reference, patient with a stub, one line naming numbers for a wrong answer.

    ``note``: text the line after ``correct`` holds, for a check that prints one; otherwise the
    reference must get exactly ``correct``.
    """
    check(solution)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:1] == ["correct"], lines
    assert len(lines) == (1 if note is None else 2), lines
    assert note is None or note in lines[1], lines
    check(stub)
    assert capsys.readouterr().out == "not attempted yet\n"
    assert wrongs, "a check is meta-tested with at least one wrong answer"
    for wrong in wrongs:
        check(wrong)
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out  # one line
        assert out not in ("correct\n", "not attempted yet\n"), out
        assert any(ch.isdigit() for ch in out), out  # names the numbers


def check_tests(module, cases, notes=None):
    """One test per ``check_*`` of ``module``: assign it to a ``test_`` name to collect it.

    ``cases``: ``(check, solution, wrong answers)`` rows; ``notes``: by check, text of the line
    it prints after ``correct``, for the checks that print one. A check with no row fails its
    test, so a new exercise cannot ship untested.
    """
    rows = {check.__name__: (check, solution, wrongs) for check, solution, wrongs in cases}
    notes = notes or {}

    @pytest.mark.parametrize("name", [name for name in vars(module) if name.startswith("check_")])
    def test_check(capsys, name):
        assert name in rows, f"{module.__name__}.{name} has no meta-test: add a row to CASES"
        check, solution, wrongs = rows[name]
        assert_check_behaves(capsys, check, solution, wrongs, note=notes.get(check))

    return test_check


def write(cache, start, k, v):
    """Token by token, every layer, as decode steps write (a ring's views stay its slots)."""
    for t in range(k.shape[0]):
        for layer in range(cache.n_layers):
            cache.write(layer, start + t, k[t : t + 1] + layer, v[t : t + 1] - layer)
        cache.seq_len = start + t + 1
