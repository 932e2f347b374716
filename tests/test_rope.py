import torch

from hf_kvcodecs.rope import (
    RotaryHalfTable,
    apply_rope,
    find_rotary_parameters,
    rotary_cos_sin,
    shared_rotary_half_table,
    undo_rope,
)


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


def test_rotary_half_table_gives_the_first_half_of_the_computed_angles():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    table = RotaryHalfTable(inv_freq, 1.5)
    cases = {
        "consecutive": torch.arange(40, 60, dtype=torch.int32)[None],
        "beyond the first growth": torch.arange(1500, 1530, dtype=torch.int32)[None],
        "batch of different rows": torch.tensor([[0, 0, 1, 2], [5, 6, 7, 8]], dtype=torch.int32),
        "gaps": torch.tensor([[3, 9, 4, 100]], dtype=torch.int32),
        "negative (a padding convention)": torch.tensor([[-1, 0, 1]], dtype=torch.int32),
    }
    for name, positions in cases.items():
        cos, sin = rotary_cos_sin(positions, inv_freq, 1.5)
        half_cos, half_sin = table.halves(positions)
        assert half_cos.shape == (*positions.shape, 8) and half_cos.is_contiguous(), name
        torch.testing.assert_close(half_cos, cos[..., :8], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(half_sin, sin[..., :8], rtol=0, atol=1e-6, msg=name)
        assert torch.equal(cos[..., :8], cos[..., 8:]), "the loops rely on equal halves"
    assert table.cos.shape[0] == 2048  # grown in whole steps to cover position 1529
    # one consecutive row is a view of the table, not a copy
    view, _ = table.halves(torch.arange(10, 20, dtype=torch.int32)[None])
    assert view.untyped_storage().data_ptr() == table.cos.untyped_storage().data_ptr()


def test_caches_of_the_same_rotary_parameters_share_one_half_table():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    first = shared_rotary_half_table(inv_freq, 1.0)
    assert shared_rotary_half_table(inv_freq.clone(), 1.0) is first
    assert shared_rotary_half_table(inv_freq, 2.0) is not first
