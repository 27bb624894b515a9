"""Analytic memory estimator: hand-computed numbers and monotonic properties."""

from __future__ import annotations

import pytest

from canntrain_core.memory import GB, GiB, LoraSetup, TrainSetup, estimate, parse_bytes, shape_from_preset
from canntrain_core.sizing.activations import layer_activations
from canntrain_core.sizing.shapes import ModelShape

N_7B = 6_738_415_616  # llama2-7b parameters, counted from the shapes


def test_7b_parameter_count_and_model_states_are_16_bytes_per_parameter():
    shape = shape_from_preset("llama2-7b")
    assert shape.num_params() == N_7B
    est = estimate(shape, TrainSetup(precision="bf16"))
    # amp (canntrain's trainer): fp32 weights 4 B + fp32 grads 4 B + AdamW m, v 8 B
    assert est.states == {"parameters": 4 * N_7B, "gradients": 4 * N_7B, "optimizer_states": 8 * N_7B}
    assert est.model_states == 16 * N_7B == 107_814_649_856  # 107.8 GB; "112 GB" is 16 B x 7.0e9


def test_seed_arithmetic_with_half_weights_and_fp32_master():
    shape = shape_from_preset("llama2-7b")
    est = estimate(shape, TrainSetup(precision="bf16", weights="half"))
    assert est.states["parameters"] == 2 * N_7B  # 13.5 GB ("14 GB")
    assert est.states["gradients"] == 2 * N_7B
    assert est.states["optimizer_states"] == 12 * N_7B  # master + m + v: 80.9 GB ("84 GB")
    assert round(16 * 7.0e9 / GB) == 112


def test_layer_activations_hand_computed():
    # h=256, i=640, 8 heads, 2 kv heads (kv width 64), b=2, s=64 -> 128 tokens
    shape = ModelShape("llama", 256, 640, 1, 8, 2, 1000)
    s = TrainSetup(precision="bf16", micro_batch=2, seq_length=64)
    la = layer_activations(shape, s)
    assert la.tensors == 128 * (30 * 256 + 4 * 64 + 8 * 640 + 4 * 8 + 8)  # counted with saved-tensor hooks
    assert la.weight_copies == 2 * (256 * 256 * 2 + 64 * 256 * 2 + 2 * 640 * 256 + 256 * 640)
    fp32 = layer_activations(shape, s.but(precision="fp32"))
    assert fp32.tensors == 128 * (24 * 256 + 8 + 8 * 256 + 8 * 64 + 4 * 8 + 16 * 640)
    assert fp32.weight_copies == 0
    full = layer_activations(shape, s.but(recompute="full"))
    assert full.total == 128 * 4 * 256  # only the fp32 block input


def test_tensor_parallel_with_sequence_parallel_divides_activations():
    shape = shape_from_preset("llama2-7b")
    s = TrainSetup(micro_batch=1, seq_length=4096)
    one, two = layer_activations(shape, s), layer_activations(shape, s.but(tp=2, dp=1, sequence_parallel=True))
    assert two.tensors == one.tensors // 2
    no_sp = layer_activations(shape, s.but(tp=2, sequence_parallel=False))
    assert no_sp.tensors > two.tensors


def test_flash_attention_removes_the_score_term():
    shape = shape_from_preset("llama2-7b")
    s = TrainSetup(micro_batch=1, seq_length=4096)
    extra = layer_activations(shape, s.but(flash_attention=False)).tensors - layer_activations(shape, s).tensors
    assert extra == 4096 * 5 * 32 * 4096  # 5 a s bytes per token


@pytest.mark.parametrize("preset", ["llama2-7b", "llama2-70b", "gpt3-13b", "mixtral-8x7b"])
def test_more_recompute_never_raises_activations(preset):
    shape = shape_from_preset(preset)
    s = TrainSetup(micro_batch=2, seq_length=4096, tp=2, pp=2, dp=2)
    acts = [layer_activations(shape, s, r).total for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


@pytest.mark.parametrize("preset", ["llama2-70b", "mixtral-8x7b"])
def test_more_sharding_never_raises_model_states(preset):
    shape = shape_from_preset(preset)
    base = TrainSetup(micro_batch=1, seq_length=4096, dp=16)
    prev = None
    for zero in (0, 1, 2, 3):
        ms = estimate(shape, base.but(zero=zero)).model_states
        assert prev is None or ms <= prev
        prev = ms
    for key in ("tp", "pp"):
        prev = None
        for k in (1, 2, 4, 8):
            ms = estimate(shape, base.but(**{key: k, "dp": 16 // k}, zero=0)).model_states
            assert prev is None or ms <= prev, (key, k)
            prev = ms


def test_70b_tp8pp2_and_tp4pp4_hold_the_same_model_states():
    shape = shape_from_preset("llama2-70b")
    s = TrainSetup(micro_batch=1, seq_length=4096, grad_accum=8)
    a, b = estimate(shape, s.but(tp=8, pp=2)), estimate(shape, s.but(tp=4, pp=4))
    # both split the weights 16 ways: 16 B x 69 B / 16 = 69 GB, up to where the embedding/head sit
    for est in (a, b):
        assert 0.95 * 16 * shape.num_params() / 16 <= est.model_states <= 1.06 * 16 * shape.num_params() / 16
    assert abs(a.model_states - b.model_states) / a.model_states < 0.05


def test_offload_moves_optimizer_to_host_and_lora_shrinks_states():
    shape = shape_from_preset("llama2-7b")
    s = TrainSetup(micro_batch=1, seq_length=1024)
    off = estimate(shape, s.but(offload_optimizer=True))
    assert off.states["optimizer_states"] == 0 and off.host_bytes >= 8 * N_7B
    lora = estimate(shape, s.but(lora=LoraSetup(rank=16)))
    trainable = 32 * 16 * (4096 + 4096) * 4  # q, k, v, o: rank x (in + out) each
    assert lora.states["gradients"] == 4 * trainable and lora.states["optimizer_states"] == 8 * trainable
    # the frozen base in bf16 (the setup's precision: the trainer casts it), the adapters in fp32
    assert lora.states["parameters"] == 2 * N_7B + 4 * trainable
    assert estimate(shape, s.but(lora=LoraSetup(rank=16), precision="fp32")).states["parameters"] == 4 * (
        N_7B + trainable
    )


def test_expert_parallel_divides_experts():
    """Without FSDP a rank holds its ep share of the experts; under FSDP2 it holds 1/dp of every tensor either
    way (EP's experts sharded over dp/ep), and EP shrinks the gathered layer: 8x7B's experts are 97.1 % of a
    layer, so FSDP8's two gathered bf16 blocks fall from 5.41 to 0.81 GiB with ep 8."""
    shape = shape_from_preset("mixtral-8x7b")
    s = TrainSetup(micro_batch=1, seq_length=4096, dp=8)
    assert estimate(shape, s.but(ep=8)).states["parameters"] < estimate(shape, s).states["parameters"] / 4
    f = s.but(zero=3, precision="bf16")
    one, eight = estimate(shape, f), estimate(shape, f.but(ep=8))
    assert one.states == eight.states  # parameters, gradients, optimizer states at rest
    layer = sum(o * i for _, o, i in shape.layer_matrices()) + shape.layer_vectors()
    experts = 8 * 3 * 4096 * 14336
    assert one.categories["communication_buffers"] == 2 * 2 * layer
    assert eight.categories["communication_buffers"] == 2 * 2 * (layer - experts + experts // 8)


def test_fits_and_errors_name_the_bad_value():
    est = estimate(shape_from_preset("llama2-7b"), TrainSetup())
    assert not est.fits(parse_bytes("64GiB")) and est.fits(parse_bytes("1TiB"))
    assert parse_bytes("910b") == 64 * GiB and parse_bytes("80GB") == 80e9
    with pytest.raises(ValueError, match="zero_optimization"):
        TrainSetup(zero=5)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainSetup(recompute="most")
    with pytest.raises(ValueError, match="64 GiBs"):
        parse_bytes("64 GiBs")
    with pytest.raises(KeyError, match="llama2-7b"):
        shape_from_preset("llama4-8b")


def test_the_trainers_mfu_and_the_planner_read_one_device_table():
    from canntrain_core.sizing.devices import DEVICES, spec_of_device

    assert spec_of_device("Ascend910B3") is DEVICES["910b"]
    assert spec_of_device("NVIDIA H100 80GB HBM3") is DEVICES["h100-80g"]
    assert spec_of_device("NVIDIA H200").peak_flops == 989e12
    assert spec_of_device("cpu") is None
