"""The cost model reads each op's dtype (fp32 matmuls at the CUDA cores' rate on GPUs) and the cluster file's units
(bits are not bytes)."""

import pytest
import torch

from autopart.cost import PRESETS, preset, roofline_time
from autopart.cost.cluster import load_preset
from autopart.cost.compute import attention_time, compute_dtype, dtype_peak_flops, node_bytes, node_flops

aten = torch.ops.aten


def _mm_time(device, dtype, n=8192):
    a, b = torch.empty(n, n, dtype=dtype, device="meta"), torch.empty(n, n, dtype=dtype, device="meta")
    out = torch.empty(n, n, dtype=dtype, device="meta")
    flops, nbytes = node_flops(aten.mm.default, (a, b), {}, out), node_bytes((a, b), out, aten.mm.default)
    return roofline_time(flops, nbytes, device, aten.mm.default, {}, dtype=compute_dtype((a, b), out))


def test_fp32_gemm_priced_at_the_fp32_peak():
    """An 8192^3 GEMM (compute-bound in either dtype) in fp32 on h100-80gb takes 989/67 x its bf16 time (67 TFLOP/s
    on the CUDA cores, PyTorch's default without TF32); bf16 and fp16 are priced as before, at peak_flops."""
    h100 = PRESETS["h100-80gb"].device
    assert (h100.fp32_flops, h100.tf32_flops) == (67e12, 494.7e12)
    bf16, fp32 = _mm_time(h100, torch.bfloat16), _mm_time(h100, torch.float32)
    assert fp32 / bf16 == pytest.approx(989 / 67, rel=1e-9)
    assert fp32 == pytest.approx(2 * 8192**3 / (67e12 * h100.mfu))
    assert bf16 == _mm_time(h100, torch.float16) == roofline_time(2 * 8192**3, 3 * 2 * 8192**2, h100,
                                                                   aten.mm.default, {})  # bit for bit
    a100 = PRESETS["a100-80gb"].device
    assert _mm_time(a100, torch.float32) / _mm_time(a100, torch.bfloat16) == pytest.approx(312 / 19.5, rel=1e-9)
    assert PRESETS["h200-141gb"].device.fp32_flops == 67e12


def test_cpu_preset_unchanged():
    """cpu's peak_flops is fp32's (fp32_flops 0): every dtype keeps its rate."""
    cpu = preset("cpu", (2,)).device
    assert cpu.fp32_flops == 0 and dtype_peak_flops(cpu, torch.float32) == cpu.peak_flops
    fp32 = _mm_time(cpu, torch.float32, n=512)
    assert fp32 == roofline_time(2 * 512**3, 3 * 4 * 512**2, cpu, aten.mm.default, {})


def test_fp32_attention_and_convolution():
    """Fused attention in fp32 runs at attention_flops scaled by fp32/bf16 (attention_time agrees); an fp32
    convolution at the TF32 rate (cuDNN's default); an elementwise op ignores the dtype."""
    h100 = PRESETS["h100-80gb"].device
    q = torch.empty(4, 32, 4096, 128, device="meta")
    out = (torch.empty_like(q), torch.empty(4, 32, 4096, device="meta"))  # bf16/fp32 output, fp32 logsumexp
    assert compute_dtype((q.bfloat16(), q.bfloat16(), q.bfloat16()), out) is torch.bfloat16
    assert compute_dtype((q, q, q), out) is torch.float32
    target = aten._scaled_dot_product_cudnn_attention.default
    flops = 4 * 4 * 32 * 4096**2 * 128
    bf16 = roofline_time(flops, 0.0, h100, target, {}, dtype=torch.bfloat16)
    fp32 = roofline_time(flops, 0.0, h100, target, {}, dtype=torch.float32)
    assert bf16 == pytest.approx(flops / h100.attention_flops)
    assert fp32 / bf16 == pytest.approx(989 / 67)
    assert attention_time(flops, h100, torch.float32) == pytest.approx(fp32)
    assert attention_time(flops, h100, torch.bfloat16) == attention_time(flops, h100) == pytest.approx(bf16)
    conv = roofline_time(1e15, 0.0, h100, aten.convolution.default, {}, dtype=torch.float32)
    assert conv == pytest.approx(1e15 / (494.7e12 * h100.mfu))
    add = aten.add.Tensor
    assert roofline_time(1e12, 1e9, h100, add, {}, dtype=torch.float32) == roofline_time(1e12, 1e9, h100, add, {})


def test_cluster_file_fp32_rate(tmp_path):
    """A cluster file sets fp32_flops (e.g. assuming TF32) as a number or with a FLOP/s unit."""
    path = tmp_path / "tf32.toml"
    path.write_text('name = "test-tf32"\nbase = "h100-80gb"\n[device]\nfp32_flops = "494.7TFLOP/s"\n')
    try:
        d = preset(load_preset(str(path)), (8,)).device
        assert d.fp32_flops == pytest.approx(494.7e12) and d.tf32_flops == 494.7e12
        assert _mm_time(d, torch.float32) / _mm_time(d, torch.bfloat16) == pytest.approx(989 / 494.7)
        path.write_text('name = "test-bad-fp32"\nbase = "h100-80gb"\n[device]\nfp32_flops = -1\n')
        with pytest.raises(ValueError, match="fp32_flops must be >= 0"):
            load_preset(str(path))
    finally:
        PRESETS.pop("test-tf32", None)


@pytest.mark.parametrize("value,bandwidth", [
    ("400Gb", 50e9), ("400Gbit", 50e9), ("400Gbps", 50e9), ("400Gb/s", 50e9), ("400 Gbit/s", 50e9),
    ("1.6Tb/s", 200e9), ("800Mbps", 100e6),
    ("400GB", 400e9), ("400GB/s", 400e9), ("50GBps", 50e9), ("1GiB/s", 2**30), (50e9, 50e9), ("5e10", 50e9),
])
def test_cluster_file_bandwidth_units(tmp_path, value, bandwidth):
    """Bits (b, bit, bps) are an eighth of bytes (B, GiB): an NDR NIC's "400Gb/s" is 50 GB/s, not 400."""
    path = tmp_path / "units.json"
    path.write_text('{"name": "test-units", "base": "h100-80gb", "inter_node": {"bandwidth": %s}}'
                    % (f'"{value}"' if isinstance(value, str) else value))
    try:
        assert preset(load_preset(str(path)), (2, 8)).link(0).bandwidth == pytest.approx(bandwidth)
    finally:
        PRESETS.pop("test-units", None)


@pytest.mark.parametrize("section,key,value", [
    ("inter_node", "bandwidth", "400gb"), ("inter_node", "bandwidth", "400G"), ("inter_node", "bandwidth", "400Gib"),
    ("intra_node", "ll_bandwidth", "fast"), ("device", "mem_bandwidth", "3.35tb/s"),
    ("device", "memory_bytes", "640Gb"), ("device", "memory_bytes", "80GiB/s"), ("device", "peak_flops", "989TB"),
])
def test_cluster_file_ambiguous_unit_is_an_error(tmp_path, section, key, value):
    """A unit that is neither clearly bytes nor clearly bits (nor bits where a size in bytes is asked) is refused,
    the message naming the key and the value."""
    path = tmp_path / "bad.toml"
    path.write_text(f'name = "test-bad-unit"\nbase = "h100-80gb"\n[{section}]\n{key} = "{value}"\n')
    with pytest.raises(ValueError, match=rf"\[{section}\] {key}: cannot read '{value}'"):
        load_preset(str(path))
    assert "test-bad-unit" not in PRESETS
