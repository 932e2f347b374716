import torch

from hf_kvcodecs.cache.rope import apply_rope, find_rotary_parameters, rotary_cos_sin, undo_rope


def test_rotary_parameters_reproduce_the_model_and_invert_exactly(tiny_model):
    inv_freq, scaling = find_rotary_parameters(tiny_model)
    positions = torch.tensor([[0, 1, 2, 7, 100, 513]])
    cos, sin = rotary_cos_sin(positions, inv_freq, scaling)
    model_cos, model_sin = tiny_model.model.rotary_emb(torch.zeros(1, 6, 16), positions)
    torch.testing.assert_close(cos, model_cos)
    torch.testing.assert_close(sin, model_sin)
    keys = torch.randn(1, 2, 6, 16)
    restored = undo_rope(apply_rope(keys, cos, sin), cos, sin, scaling)
    assert (restored - keys).abs().max() < 1e-5
