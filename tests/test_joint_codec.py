"""The joint-head codec: one residual-VQ code per token for all KV heads, per-head scales."""

import pytest
import torch

from hf_kvcodecs.codecs.joint import JointHeadResidualVQ, fit_joint_head_residual_vq, resolve_layouts
from hf_kvcodecs.codecs.residual import (
    FP16_SCALE_BITS,
    LOG_SCALE_BITS,
    fit_transform_residual_vq,
    gaussian_rate_distortion_reference,
    joint_rate_distortion_reference,
    relative_mse,
)
from hf_kvcodecs.gsrq.attention import shared_key_table
from hf_kvcodecs.kernels import reference

HEADS, DIM = 3, 16


def _heads_sharing_a_latent(n=4000, seed=0, shared=0.8):
    """Three heads that read the same 6-dim latent through their own projections (as KV heads of one layer read one
    residual stream), plus a little private noise, with per-token gains."""
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 6, generator=generator)
    projections = torch.randn(HEADS, 6, DIM, generator=generator)
    private = torch.randn(HEADS, n, DIM, generator=generator)
    gains = torch.rand(HEADS, n, 1, generator=generator) * 2 + 0.2
    return (shared * torch.einsum("nl,hld->hnd", latent, projections) + (1 - shared) * private) * gains


def _pair(samples, per_head_stages=2, **settings):
    settings = dict(group_dim=8, codebook_bits=5, n_iter=6, **settings)
    per_head = fit_transform_residual_vq(samples, max_stages=per_head_stages, **settings)
    joint = fit_joint_head_residual_vq(samples, max_stages=HEADS * per_head_stages, **settings)
    return per_head, joint


def test_joint_code_beats_per_head_codes_at_the_same_bits_when_heads_correlate():
    samples = _heads_sharing_a_latent()
    per_head, joint = _pair(samples[:, :3000])
    assert joint.bits_per_element() == pytest.approx(per_head.bits_per_element())
    assert joint.bits_per_element() == pytest.approx((HEADS * 2 * 5 + HEADS * 8) / (HEADS * DIM))
    test = samples[:, 3000:]
    per_head_error = relative_mse(test, per_head.reconstruct(test))
    joint_error = relative_mse(test, joint.reconstruct(test))
    assert joint_error < 0.7 * per_head_error, (joint_error, per_head_error)
    # the Gaussian yardstick says the same: a joint code needs fewer bits where heads share a latent
    bits = per_head.code_bits_per_vector()
    assert joint_rate_distortion_reference(test, bits) < 0.7 * gaussian_rate_distortion_reference(test, bits)


def test_codes_are_one_row_per_token_and_each_head_keeps_its_norm():
    samples = _heads_sharing_a_latent(seed=1)
    joint = fit_joint_head_residual_vq(samples[:, :3000], max_stages=6, group_dim=8, codebook_bits=5, n_iter=4)
    test = samples[:, 3000:]
    codes, scales = joint.encode(test)
    assert codes.shape == (1, 1000, 6) and codes.dtype == torch.uint8
    assert scales.shape == (HEADS, 1000) and scales.dtype == torch.uint8
    decoded = joint.decode(codes, scales)
    ratio = decoded.norm(dim=-1) / test.norm(dim=-1)
    assert torch.all((ratio - 1).abs() < 0.02)  # one 8-bit scale level
    shrunk = joint.decode(codes, joint.encode(test, gain="rms")[1]).norm(dim=-1) / test.norm(dim=-1)
    assert shrunk.mean() < 0.99
    least_squares = joint.decode(codes, joint.encode(test, gain="least_squares")[1])
    assert relative_mse(test, least_squares) <= relative_mse(test, decoded)
    with pytest.raises(ValueError, match="different number of KV heads"):
        joint.encode(torch.randn(2, 10, DIM))
    with pytest.raises(ValueError, match="codes per vector"):
        joint.decode(codes[..., :5], scales)
    assert joint.decode(codes[:, :0], scales[:, :0]).shape == (HEADS, 0, DIM)  # an empty coded region


def test_prefixes_state_dict_and_attention_operands_describe_the_same_code():
    samples = _heads_sharing_a_latent(seed=2)
    joint = fit_joint_head_residual_vq(samples[:, :3000], max_stages=6, group_dim=8, codebook_bits=5, n_iter=4,
                                       scale_bits=FP16_SCALE_BITS)
    test = samples[:, 3000:3100]
    codes, scales = joint.encode(test, beam_width=1)
    prefix = joint.truncated(4)
    assert prefix.num_stages == 4 and prefix.bits_per_element() < joint.bits_per_element()
    assert torch.equal(prefix.encode(test, beam_width=1)[0], codes[..., :4])  # greedy codes of a prefix: a prefix
    restored = JointHeadResidualVQ.from_state_dict(joint.state_dict("layer"), "layer", 8, HEADS, joint.stats)
    assert torch.equal(restored.decode(codes, scales), joint.decode(codes, scales))
    # What the attention kernels read: head h = s_h * (mean[h] + z @ synthesis[h]) from the shared codes
    mean, synthesis, codebooks, groups = joint.attention_operands()
    assert synthesis.shape == (HEADS, HEADS * DIM, DIM)
    from_operands = reference.dequantize_reference(codes[None], joint.scale_values(scales)[None], mean, synthesis,
                                                   codebooks, groups)
    assert torch.allclose(from_operands[0], joint.decode(codes, scales), atol=1e-5)
    folded = shared_key_table(joint)
    assert folded.shape == (HEADS, 6 * 32, DIM) and shared_key_table(prefix) is folded  # prefixes share the table


def test_joint_fit_rejects_a_metric_and_bad_samples():
    samples = _heads_sharing_a_latent(n=600)
    with pytest.raises(ValueError, match="no error metric"):
        fit_joint_head_residual_vq(samples, max_stages=2, metric=torch.eye(DIM).expand(HEADS, DIM, DIM))
    with pytest.raises(ValueError, match="heads, tokens, head_dim"):
        fit_joint_head_residual_vq(samples[0], max_stages=2)
    with pytest.raises(ValueError, match="scale_bits"):
        fit_joint_head_residual_vq(samples, max_stages=2, scale_bits=4)
    codec = fit_joint_head_residual_vq(samples, max_stages=2, group_dim=8, codebook_bits=4, n_iter=2)
    assert codec.scale_bits == LOG_SCALE_BITS and codec.code_heads == 1


def test_layouts_left_out_resolve_to_the_default_for_the_key_space_and_given_ones_pass_through():
    assert resolve_layouts() == ("per_head_codebooks", "given_keys")
    # values given the keys need the keys before RoPE, so keys coded after RoPE default to joint values
    assert resolve_layouts("post_rope") == ("per_head", "joint_heads")
    assert resolve_layouts("post_rope", None, "per_head") == ("per_head", "per_head")
    assert resolve_layouts("pre_rope", "conditional_heads", None) == ("conditional_heads", "given_keys")
