"""The codec layout registry: one class per layout, and what the rest of the library reads from it."""

import pytest
import torch

from hf_kvcodecs.codecs.base import KVCodec
from hf_kvcodecs.codecs.layouts import LAYOUT_CODECS, codec_class, heads_per_code, layouts_for
from hf_kvcodecs.gsrq.codebooks import LAYOUTS

HEADS, DIM = 2, 16
SETTINGS = dict(max_stages=4, group_dim=8, codebook_bits=4, n_iter=3, seed=0)


def _fitted(layout: str) -> KVCodec:
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(HEADS, 600, DIM, generator=generator)
    codec = codec_class(layout)
    if codec.needs_keys:
        keys = torch.randn(HEADS, 600, DIM, generator=generator)
        return codec.fit(samples + 0.5 * keys, decoded_keys=keys, **SETTINGS)
    return codec.fit(samples, **SETTINGS)


def test_every_layout_is_one_registered_class():
    assert LAYOUTS == {"keys": ("per_head", "joint_heads", "per_head_codebooks", "conditional_heads"),
                       "values": ("per_head", "joint_heads", "given_keys")}
    assert layouts_for("keys") == LAYOUTS["keys"] and layouts_for("values") == LAYOUTS["values"]
    for name, codec in LAYOUT_CODECS.items():
        assert issubclass(codec, KVCodec) and codec.layout == name
    assert [heads_per_code(layout, 3) for layout in LAYOUT_CODECS] == [1, 3, 1, 1, 3]
    with pytest.raises(ValueError, match="key_layout must be one of .*'conditional_heads'.*got 'given_keys'"):
        codec_class("given_keys", "keys")
    with pytest.raises(ValueError, match="layout must be one of"):
        codec_class("per_token")


@pytest.mark.parametrize("layout", list(LAYOUT_CODECS))
def test_fitted_codec_has_its_layout_and_survives_truncation_and_a_state_dict(layout):
    codec = _fitted(layout)
    assert type(codec) is codec_class(layout) and codec.layout == layout
    assert codec.code_heads == (1 if codec.joint_code else HEADS)
    # index bits plus one scale per head vector, per element
    bits = (codec.code_heads * codec.num_stages * codec.codebook_bits + HEADS * codec.scale_bits) / (HEADS * DIM)
    assert codec.bits_per_element() == pytest.approx(bits)
    shorter = codec.truncated(2)
    assert type(shorter) is type(codec) and shorter.num_stages == 2
    restored = type(codec).from_state_dict(codec.state_dict("layer"), "layer", 8, HEADS, codec.stats)
    assert type(restored) is type(codec)
    assert restored.consistency_problems(4, 8, codec.scale_bits) == []
    assert restored.consistency_problems(5, 8, codec.scale_bits) != []  # another codebook size than the file says
    x = torch.randn(HEADS, 5, DIM, generator=torch.Generator().manual_seed(1))
    keys = torch.randn(HEADS, 5, DIM, generator=torch.Generator().manual_seed(2))
    arguments = (x, keys) if codec.needs_keys else (x,)
    torch.testing.assert_close(restored.reconstruct(*arguments), codec.reconstruct(*arguments))


def test_head_codebooks_codec_refuses_predictors():
    codec = _fitted("conditional_heads")
    with pytest.raises(ValueError, match="per_head_codebooks codec codes its heads independently"):
        codec_class("per_head_codebooks")(codec.head_codecs, codec.predictors, {})
    with pytest.raises(ValueError, match="holds cross-head predictors"):
        codec_class("per_head_codebooks").from_state_dict(codec.state_dict("layer"), "layer", 8, HEADS)
