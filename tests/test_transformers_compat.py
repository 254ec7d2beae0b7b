"""The target's KV cache reaches the model under every supported transformers (the argument was renamed)."""

from __future__ import annotations

import torch

from adaptivespec.models import cache_forward


class OldModel(torch.nn.Module):
    """A model as transformers < 5.24 declares it: the cache is ``past_key_values``, extra keywords are swallowed."""

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return {"cache": past_key_values, "swallowed": sorted(kwargs)}


class NewModel(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return {"cache": cache, "swallowed": sorted(kwargs)}


def test_an_older_model_gets_the_cache_as_past_key_values():
    cache = object()
    out = cache_forward(OldModel())(input_ids=torch.zeros(1, 1), cache=cache, use_cache=True)
    assert out == {"cache": cache, "swallowed": []}  # passed as is, it would land in **kwargs, unused


def test_a_current_model_is_called_as_it_is():
    model = NewModel()
    assert cache_forward(model) is model
    assert model(cache="c")["cache"] == "c"


def test_the_installed_transformers_model_takes_the_cache_it_is_given():
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        cache_forward(model)(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 3
