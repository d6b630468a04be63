"""Tests for ssm.py, the block S4, S4D and DLR share: each test runs over every kernel (S4 NPLR, S4D, DLR) and is
named after the fact it checks (float64 for equivalences, tiny sizes, CPU). Kernel math lives in test_s4/test_dlr."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import dlr
import models
import s4
from lab import presets
from dlr import DLR, DLRConfig, DLRKernel
from s4 import S4, S4Config, S4Kernel
import ssm
from ssm import RFFT, SSMLayer, fft_conv, fft_length, masked_batch_norm, vandermonde
from conftest import default_dtype

# name -> (Config, Kernel, Backbone, SSM_PARAMS, the config fields that pick the kernel, d_state of the small tests)
KERNELS = {
    "s4-nplr": (S4Config, S4Kernel, S4, s4.SSM_PARAMS, dict(mode="nplr"), 8),
    "s4-diag": (S4Config, S4Kernel, S4, s4.SSM_PARAMS, dict(mode="diag"), 8),
    "dlr": (DLRConfig, DLRKernel, DLR, dlr.SSM_PARAMS, dict(), 32),
}
over_kernels = pytest.mark.parametrize("name", list(KERNELS))


def config(name, **fields):
    """The config of kernel `name`, with the small test d_state unless fields give one."""
    Config, _, _, _, picks, d_state = KERNELS[name]
    return Config(**{"d_state": d_state, **picks, **fields})




def kernel_of(name, **fields):
    return KERNELS[name][1](config(name, **fields))


def backbone_of(name, **fields):
    return KERNELS[name][2](config(name, **fields))


# ----------------------------------------------------------------------------- FFT convolution, Vandermonde, RFFT

def test_fft_conv_equals_naive_sums_with_backward_branch_shifted_by_one():
    torch.manual_seed(0)
    L = 7
    u, k = torch.randn(2, 3, L, dtype=torch.float64), torch.randn(2, 3, L, dtype=torch.float64)
    causal = torch.zeros_like(u)
    bidir = torch.zeros_like(u)
    for t in range(L):
        for s in range(L):
            if s <= t:
                causal[..., t] += k[0, :, t - s] * u[..., s]
            else:                                                     # backward kernel: lag s − t − 1, u_t counted once
                bidir[..., t] += k[1, :, s - t - 1] * u[..., s]
    torch.testing.assert_close(fft_conv(u, k[0]), causal, msg="causal FFT conv != Σ_{s≤t} k_{t−s} u_s")
    torch.testing.assert_close(fft_conv(u, k), causal + bidir, msg="bidirectional FFT conv != naive sums")


def smooth(n):
    for p in (2, 3, 5, 7):
        while n % p == 0:
            n //= p
    return n == 1


@pytest.mark.parametrize("L", [4001, 1009, 30])                       # 4001 and 1009 are prime: 2L = 2·prime
def test_fft_conv_at_a_length_with_a_large_prime_factor_uses_a_smooth_size_and_the_same_result(L, monkeypatch):
    torch.manual_seed(0)
    u, k = torch.randn(1, 2, L, dtype=torch.float64), torch.randn(2, 2, L, dtype=torch.float64)   # (B, H, L), (2, H, L)
    sizes, apply = [], RFFT.apply
    monkeypatch.setattr(RFFT, "apply", lambda x, n: sizes.append(n) or apply(x, n))
    got = {"causal": fft_conv(u, k[0]), "bidirectional": fft_conv(u, k)}
    assert sizes and all(n >= 2 * L and smooth(n) for n in sizes), f"FFT sizes {sizes} for L = {L}"
    n = 2 * L                                                          # the plain length-2L reference
    ref0 = torch.fft.irfft(torch.fft.rfft(u, n) * torch.fft.rfft(k[0], n), n)[..., :L]
    k_full = torch.cat([k[0], k[1].flip(-1)], -1)                      # backward half at the end of the 2L period
    ref = torch.fft.irfft(torch.fft.rfft(u, n) * torch.fft.rfft(k_full, n), n)[..., :L]
    torch.testing.assert_close(got["causal"], ref0, rtol=0, atol=1e-10, msg="causal result changed with the size")
    torch.testing.assert_close(got["bidirectional"], ref, rtol=0, atol=1e-10, msg="bidirectional result changed")


def test_fft_length_is_the_next_length_with_no_prime_factor_above_7():
    assert [fft_length(n) for n in (8002, 8064, 2048, 11, 2 * 1009)] == [8064, 8064, 2048, 12, 2025]
    assert all(not smooth(m) for m in range(8002, 8064)), "8,064 is the first smooth length from 8,002"


@over_kernels
def test_impulse_at_last_position_does_not_reach_t0(name):
    L = 32
    with default_dtype(torch.float64):
        kernel = kernel_of(name, d_model=4, bidirectional=False)
    u = torch.zeros(1, 4, L, dtype=torch.float64)
    u[..., -1] = 1.0
    with torch.no_grad():
        y = fft_conv(u, kernel(L))
    assert y[..., :-1].abs().max() < 1e-12, "the convolution wrapped around: circular instead of linear"


@pytest.mark.parametrize("R,L", [(1, 1000), (3, 1000), (4, 5)])
def test_vandermonde_split_powers_equal_direct_powers_and_their_gradients(R, L):
    torch.manual_seed(0)                                               # L = 1000: not a multiple of the split c
    coef = torch.randn(2, R, 6, dtype=torch.complex128, requires_grad=True)
    log_w = torch.complex(-torch.rand(2, 6, dtype=torch.float64) / 50, 3 * torch.randn(2, 6, dtype=torch.float64))
    log_w.requires_grad_()
    l = torch.arange(L, dtype=torch.float64)
    direct = (coef @ torch.exp(log_w[:, :, None] * l)).real          # (2, R, L), the full (M, L) table
    split = vandermonde(coef, log_w, L)
    torch.testing.assert_close(split, direct, rtol=0, atol=1e-10, msg="split powers != Re Σ coef w^l")
    weight = torch.randn(2, R, L, dtype=torch.float64)
    g_direct = torch.autograd.grad((direct * weight).sum(), (coef, log_w))
    g_split = torch.autograd.grad((split * weight).sum(), (coef, log_w))
    for a, b in zip(g_split, g_direct):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg="split-powers gradient != direct gradient")


@pytest.mark.parametrize("m,n", [(16, 16), (15, 15), (10, 21), (10, 20)])
def test_rfft_backward_equals_torch_rfft_backward_and_is_dense(m, n):
    torch.manual_seed(0)                                               # even/odd n, with and without zero-padding
    x = torch.randn(3, 2, m, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 2, n // 2 + 1, dtype=torch.complex128)
    torch.testing.assert_close(RFFT.apply(x, n), torch.fft.rfft(x, n=n), msg="RFFT forward != torch.fft.rfft")
    ours, = torch.autograd.grad(RFFT.apply(x, n), x, g)
    ref, = torch.autograd.grad(torch.fft.rfft(x, n=n), x, g)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg="RFFT backward != adjoint of rfft")
    assert ours.stride(-1) == 1, "gradient should be dense along the last dim (BLAS needs unit stride)"


# ----------------------------------------------------------------------------- the kernels, through the block

@over_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("L", [16, 17])
@pytest.mark.parametrize("norm,prenorm", [("layer", True), ("layer", False), ("batch", False)])
def test_layer_convolution_equals_step_by_step_recurrence(name, dtype, tol, L, norm, prenorm):
    torch.manual_seed(0)
    cfg = config(name, d_model=4, bidirectional=False, dropout=0.0, prenorm=prenorm)
    with default_dtype(dtype):
        layer = SSMLayer(cfg, KERNELS[name][1](cfg)).eval()
        if norm == "batch":   # configs refuse it for a causal layer (it leaks in training); eval BatchNorm is causal
            layer.norm = nn.BatchNorm1d(4).eval()
            layer.norm.running_mean.normal_(), layer.norm.running_var.uniform_(0.5, 2)   # non-trivial statistics
    u = torch.randn(2, L, 4, dtype=dtype)
    state, ys = layer.initial_state(2), []
    with torch.no_grad():
        for t in range(L):
            y_t, state = layer.step(u[:, t], state)
            ys.append(y_t)
        torch.testing.assert_close(torch.stack(ys, 1), layer(u), rtol=tol, atol=tol,
                                   msg="recurrent and FFT views disagree")


@over_kernels
def test_kernel_at_length_16384_is_finite_with_finite_grads(name):
    kernel = kernel_of(name, d_model=2, d_state=256 if name == "dlr" else 16)  # bidirectional: both directions
    K = kernel(16384)
    assert K.shape == (2, 2, 16384) and torch.isfinite(K).all(), "non-finite kernel at L = 16384"
    K.pow(2).mean().backward()
    for pname, p in kernel.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"non-finite gradient for {pname}"


@over_kernels
def test_kernel_autograd_keeps_no_table_of_modes_by_length(name):
    L = 4096                                                           # S4: Hk = 4 SSMs of N/2 = 32 modes (N = 64);
    kernel = kernel_of(name, d_model=2 if name != "dlr" else 4, d_state=64 if name != "dlr" else 256)  # DLR: 2 × 256
    modes = (kernel.Lambda_re if name != "dlr" else kernel.lambda_p).numel()   # complex modes over all SSMs
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        K = kernel(L)
    K.square().sum().backward()
    assert max(sizes) < modes * L / 8, f"autograd keeps a {max(sizes)}-element tensor: a (modes, L) table?"


@over_kernels
def test_ssm_params_are_real_and_named_in_ssm_params(name):
    model = backbone_of(name, d_model=4, n_layers=1, d_state=8)
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()}
    absent = {"P"} if name == "s4-diag" else set()                    # S4D has no low-rank term P
    assert not any(p.is_complex() for p in model.parameters()), "AdamW must not see complex parameters"
    assert KERNELS[name][3] - absent <= leaves and not absent & leaves, leaves


@over_kernels
def test_ssm_convolution_runs_in_float32_under_autocast(name, monkeypatch):
    seen, rfft = [], torch.fft.rfft
    monkeypatch.setattr(torch.fft, "rfft", lambda x, *a, **k: seen.append(x.dtype) or rfft(x, *a, **k))
    cfg = config(name, d_model=4, d_state=8)
    layer = SSMLayer(cfg, KERNELS[name][1](cfg))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(2, 10, 4).bfloat16())
    assert seen and all(d == torch.float32 for d in seen), f"FFT ran in {seen}"
    assert torch.isfinite(y.float()).all()


# ----------------------------------------------------------------------------- precision: TF32

def tf32_round(x):
    """x rounded to TF32 (float32 with a 10-bit mantissa: 13 low bits cleared, round to nearest even); complex: both
    parts. Returns float32 / complex64, as a tensor core would read the operand."""
    if x.is_complex():
        return torch.view_as_complex(tf32_round(torch.view_as_real(x)).contiguous())
    i = x.contiguous().view(torch.int32)
    return ((i + 0xFFF + ((i >> 13) & 1)) & ~0x1FFF).view(torch.float32)


MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.mm,
           torch.Tensor.mm, torch.einsum}


class EmulatedTF32(TorchFunctionMode):
    """CUDA's TF32 on the CPU: while the process allows TF32 (cuBLAS's own query), every float32 / complex64 matmul reads
    its operands rounded to TF32 and multiplies them exactly (float64), as tensor cores do. `calls` records, for
    each float32 matmul, whether TF32 was allowed at that moment."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in MATMULS and tensors and all(t.dtype in (torch.float32, torch.complex64) for t in tensors):
            self.calls.append(torch._C._get_cublas_allow_tf32())
            if self.calls[-1]:
                wide = [tf32_round(a).to(torch.complex128 if a.is_complex() else torch.float64)
                        if isinstance(a, torch.Tensor) else a for a in args]
                out = func(*wide, **kwargs)
                return out.to(torch.complex64 if out.is_complex() else torch.float32)
        return func(*args, **kwargs)


@pytest.fixture
def tf32_allowed():
    """The process allows TF32, as `--precision tf32` does (and runs.precision did for bf16 before)."""
    old = ssm.set_matmul_precision("high")
    yield
    ssm.set_matmul_precision(old)


def paper_kernel(name, task):
    """The SSM kernel of one layer of --preset paper on `task` (S4D: S4's with mode="diag"), float32."""
    model = "dlr" if name == "dlr" else "s4"
    cfg = presets.config_for(model, task, presets.values_for("paper", model, task, False))
    torch.manual_seed(0)
    return KERNELS[name][1](dataclasses.replace(cfg, **KERNELS[name][4]))


@over_kernels
@pytest.mark.parametrize("task", ["pathx", "pathfinder"])
def test_kernel_under_emulated_tf32_stays_within_1e_3_of_float64_in_every_channel(name, task, tf32_allowed):
    # PathX: H = 256 (bidirectional: 512 SSMs), N = 64 (DLR 1,024), L = 16,384, Δ from 1e-4 (S4): with TF32 in its
    # matmuls S4's squarings and Vandermonde product put every channel over 1e-3 and some over 100 %
    kernel = paper_kernel(name, task)
    L = {"pathx": 16384, "pathfinder": 1024}[task]
    with torch.no_grad():
        exact = copy.deepcopy(kernel).double()(L).reshape(-1, L)                     # (channels, L) float64
        with EmulatedTF32() as mode:
            K = kernel(L).reshape(-1, L).double()                                    # (channels, L)
    assert mode.calls and not any(mode.calls), "the kernel ran a float32 matmul with TF32 allowed"
    error = (K - exact).norm(dim=-1) / exact.norm(dim=-1)                             # (channels,)
    assert error.max() < 1e-3, f"{name} on {task}: {int((error > 1e-3).sum())} of {len(error)} channels over 1e-3 " \
                               f"(worst {error.max():.2e}) under TF32"


def test_emulated_tf32_would_corrupt_the_unguarded_s4_kernel(tf32_allowed, monkeypatch):
    # the same check with the guard off (plain `@`, as before): it must fail, or the test above proves nothing
    monkeypatch.setattr(ssm, "TF32_IN_KERNELS", True)
    kernel = paper_kernel("s4-nplr", "pathfinder")
    with torch.no_grad():
        exact = copy.deepcopy(kernel).double()(1024).reshape(-1, 1024)
        with EmulatedTF32() as mode:
            K = kernel(1024).reshape(-1, 1024).double()
    error = (K - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert all(mode.calls) and (error > 1e-2).sum() > 50, f"TF32 emulation too weak: worst {error.max():.2e}"


@over_kernels
def test_kernel_matmuls_run_without_tf32_forward_and_backward(name, tf32_allowed, monkeypatch):
    # autograd runs the backward later, outside any context around the forward: both must be guarded
    calls, matmul = [], torch.Tensor.__matmul__
    def spy(a, b):
        if a.dtype in (torch.float32, torch.complex64):
            calls.append(torch._C._get_cublas_allow_tf32())
        return matmul(a, b)
    kernel = kernel_of(name, d_model=4, d_state=16)
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    K = kernel(64)
    forward = len(calls)
    grads = torch.autograd.grad(K.square().sum(), list(kernel.parameters()))
    assert forward >= 1 and len(calls) > forward, f"matmuls seen: {forward} forward, {len(calls) - forward} backward"
    assert not any(calls), f"TF32 allowed in {sum(calls)} of the kernel's {len(calls)} matmuls"
    assert torch._C._get_cublas_allow_tf32(), "the process's own setting was not restored"
    assert all(torch.isfinite(g).all() for g in grads)


def test_exact_matmul_has_the_gradients_of_plain_matmul():
    torch.manual_seed(0)
    a = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, 2, dtype=torch.float64)
    torch.testing.assert_close(ssm.Matmul.apply(a, b), a @ b)
    ours, ref = torch.autograd.grad(ssm.Matmul.apply(a, b), (a, b), g), torch.autograd.grad(a @ b, (a, b), g)
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg="Matmul's backward != matmul's")


# ----------------------------------------------------------------------------- backbones: shapes, causality, padding

@over_kernels
def test_backbone_maps_tokens_and_floats_to_features(name):
    tokens = backbone_of(name, d_model=8, n_layers=2, d_state=16, vocab_size=20)
    floats = backbone_of(name, d_model=8, n_layers=2, d_state=16, d_input=2, bidirectional=False)
    assert tokens(torch.randint(0, 20, (3, 11))).shape == (3, 11, 8)
    assert floats(torch.randn(3, 11, 2)).shape == (3, 11, 8)


@over_kernels
@pytest.mark.parametrize("training", [False, True])
def test_unidirectional_outputs_ignore_future_inputs(name, training):
    # training: tied dropout on, each run from the same seed so both draw the same masks
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        model = backbone_of(name, d_model=8, n_layers=2, d_state=16, bidirectional=False, d_input=2, dropout=0.1)
    model.train(training)
    x, t0 = torch.randn(2, 20, 2, dtype=torch.float64), 11
    x2 = x.clone()
    x2[:, t0 + 1:] = torch.randn(2, 20 - t0 - 1, 2, dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(1)
        y = model(x)
        torch.manual_seed(1)
        y2 = model(x2)
    torch.testing.assert_close(y2[:, : t0 + 1], y[:, : t0 + 1], rtol=0, atol=1e-10, msg=f"causal {name} saw the future")
    assert (y2[:, t0 + 1:] - y[:, t0 + 1:]).abs().max() > 1e-3, "changed inputs should change later outputs"


@pytest.mark.parametrize("Config", [S4Config, DLRConfig])
def test_unidirectional_config_with_batchnorm_is_refused(Config):
    with pytest.raises(ValueError, match="norm='batch' with bidirectional=False: .* leak .*use norm='layer'"):
        Config(norm="batch", bidirectional=False)
    Config(norm="batch", bidirectional=True), Config(norm="layer", bidirectional=False)   # these stay allowed


@over_kernels
@pytest.mark.parametrize("inputs", ["tokens", "floats"])
def test_bidirectional_padded_batch_equals_each_sequence_alone(name, inputs):
    torch.manual_seed(0)
    kind = dict(vocab_size=12) if inputs == "tokens" else dict(d_input=2)
    model = backbone_of(name, d_model=8, n_layers=2, d_state=16, dropout=0.0, **kind).eval()
    lengths = torch.tensor([9, 5, 0])                                  # the last row is all padding
    pads = torch.arange(9) >= lengths[:, None]                         # (B, L)
    if inputs == "tokens":
        x = torch.randint(4, 12, (3, 9)) * ~pads
    else:
        x = torch.randn(3, 9, 2)
        x[pads] = 7.0                                                  # junk in the pads must not matter
    y = model(x, lengths)
    for b in range(2):
        alone = model(x[b:b + 1, : lengths[b]])
        torch.testing.assert_close(y[b, : lengths[b]], alone[0], rtol=1e-5, atol=1e-5, msg=f"row {b}: padding leaked")
    y.sum().backward()
    assert torch.isfinite(y).all(), "all-padding row gives non-finite features"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), "non-finite grads"


@over_kernels
def test_batchnorm_in_training_ignores_pad_content(name):
    torch.manual_seed(0)
    model = backbone_of(name, d_model=8, n_layers=2, d_state=8, vocab_size=12, dropout=0.0, norm="batch", prenorm=False)
    lengths = torch.tensor([9, 5])
    real = torch.arange(9) < lengths[:, None]                          # (B, L)
    x = torch.randint(4, 12, (2, 9))
    y_zero_pads = model(x * real, lengths)
    y_junk_pads = model(x, lengths)                                    # same real tokens, junk in the pads
    torch.testing.assert_close(y_junk_pads[real], y_zero_pads[real], msg="BatchNorm statistics saw the pads")


@pytest.mark.parametrize("training", [True, False])
def test_masked_batchnorm_equals_batchnorm_of_the_real_positions_alone(training):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 4, dtype=torch.float64, requires_grad=True)  # (B, L, H)
    mask = torch.arange(7) < torch.tensor([7, 4, 1])[:, None]          # (B, L)
    with default_dtype(torch.float64):
        ours, ref = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    for norm in (ours, ref):
        norm.train(training)
        norm.weight.data.uniform_(0.5, 2), norm.bias.data.normal_()
        norm.running_mean.normal_(), norm.running_var.uniform_(0.5, 2)
    ref.load_state_dict(ours.state_dict())
    y = masked_batch_norm(ours, x, mask)                              # (B, L, H), pads 0
    y_ref = torch.zeros_like(y).masked_scatter(mask[..., None], ref(x[mask]))   # BatchNorm of the real rows only
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12, msg="masked BatchNorm != BatchNorm of x[mask]")
    weight = torch.randn_like(y)
    grads = torch.autograd.grad((y * weight).sum(), [x, ours.weight, ours.bias])
    grads_ref = torch.autograd.grad((y_ref * weight).sum(), [x, ref.weight, ref.bias])
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg="masked BatchNorm gradient != BatchNorm's")
    for key, value in ref.state_dict().items():                      # running statistics moved alike
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-12, atol=1e-12, msg=f"{key} differs")


@over_kernels
@pytest.mark.parametrize("bad", [torch.tensor([[9], [5]]), torch.tensor([9]), torch.tensor(9)])
def test_lengths_not_of_shape_B_raise_value_error(name, bad):
    model = backbone_of(name, d_model=8, n_layers=1, d_state=8, vocab_size=12)
    x = torch.randint(1, 12, (2, 9))                                   # (B, L), B = 2
    with pytest.raises(ValueError, match=r"lengths has shape .*expected \(B,\) = \(2,\)"):
        model(x, bad)
    with pytest.raises(ValueError, match=r"lengths has shape .*expected \(B,\) = \(2,\)"):
        model.layers[0](torch.randn(2, 9, 8), bad)


@over_kernels
@pytest.mark.parametrize("padded", [False, True])
def test_forward_traces_as_one_graph_so_it_never_waits_for_the_device(name, padded, monkeypatch):
    # .item(), bool(tensor), .tolist(), branches on tensor values and x[mask] break a fullgraph trace; those are what
    # make the host wait for the device. The "eager" backend only traces (no compiler), so this stays fast. The
    # kernels run eagerly under torch.compile (torch.compiler.disable): trace their undecorated forward too.
    for Kernel in (S4Kernel, DLRKernel):
        monkeypatch.setattr(Kernel, "forward", Kernel.forward.__wrapped__)
    monkeypatch.setattr(SSMLayer, "kernel_of", SSMLayer.kernel_of.__wrapped__)   # (training: no cache lookup)
    monkeypatch.setattr(ssm.SSMBackbone, "forward", ssm.SSMBackbone.forward.__wrapped__)
    monkeypatch.setattr(ssm, "TF32_IN_KERNELS", True)   # plain `@`: the TF32 guard's flag calls are host-only, not syncs
    torch._dynamo.reset()
    model = backbone_of(name, d_model=8, n_layers=1, d_state=8, vocab_size=12, norm="batch", dropout=0.1)
    lengths = torch.tensor([9, 5]) if padded else None
    torch.compile(model, backend="eager", fullgraph=True)(torch.randint(1, 12, (2, 9)), lengths)


# ----------------------------------------------------------------------------- config rules shared by S4 and DLR

@pytest.mark.parametrize("Config", [S4Config, DLRConfig])
@pytest.mark.parametrize("fields,message", [
    (dict(d_model=0), "d_model=0 must be >= 1"),
    (dict(n_layers=0), "n_layers=0 must be >= 1"),
    (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
    (dict(dropout=-0.1), r"dropout=-0.1 must be in \[0, 1\)"),
    (dict(norm="group"), "norm='group' must be 'layer' or 'batch'"),
    (dict(dt_min=0.0), "dt_min=0.0, dt_max=0.1 must satisfy 0 < dt_min <= dt_max"),
    (dict(dt_min=0.2, dt_max=0.1), "dt_min=0.2, dt_max=0.1 must satisfy 0 < dt_min <= dt_max"),
    (dict(vocab_size=0), "vocab_size=0 must be None or >= 1"),
    (dict(d_input=0), "d_input=0 must be >= 1"),
])
def test_ssm_configs_refuse_bad_fields_with_a_one_line_value_error(Config, fields, message):
    with pytest.raises(ValueError, match=f"^{message}") as err:
        Config(**fields)
    assert "\n" not in str(err.value), "train.py prints these as one-line flag errors"


# ----------------------------------------------------------------------------- torch.compile (inductor)

def training_step(model, x, target):
    """One AdamW step on a fixed random readout of the features; returns the loss (detached)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = (model(x) * target).sum()                                   # not y², which the final norm makes ~flat
    loss.backward()
    opt.step()
    return loss.detach()


@over_kernels
def test_compiled_training_step_equals_eager(name):
    # The real inductor backend on CPU: the complex-valued kernels run as eager fallbacks inside the graph.
    torch.manual_seed(0)
    eager = backbone_of(name, d_model=16, n_layers=1, d_state=8, d_input=2, dropout=0.0)
    compiled = copy.deepcopy(eager)
    x, target = torch.randn(2, 32, 2), torch.randn(2, 32, 16)          # (B, L, d_input), (B, L, H)
    torch._dynamo.reset()
    loss = training_step(torch.compile(compiled), x, target)
    torch.testing.assert_close(loss, training_step(eager, x, target), rtol=1e-4, atol=1e-4, msg="compiled loss")
    for (pname, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{pname} after one compiled AdamW step")


# ---- torch's TF32 state: readable and as asked after every setter of ours, from every state a user's code can leave

# what a user's code may have set before (legacy API, torch >= 2.9's new API, set_float32_matmul_precision) -> the
# TF32 value and matmul precision it means
TF32_STARTS = {
    "allow_tf32 = True": ("torch.backends.cuda.matmul.allow_tf32 = True", True, "high"),
    "allow_tf32 = False": ("torch.backends.cuda.matmul.allow_tf32 = False", False, "highest"),
    "fp32_precision = 'tf32'": ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", True, "high"),
    "fp32_precision = 'ieee'": ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", False, "highest"),
    **{f"set_float32_matmul_precision('{p}')": (f"torch.set_float32_matmul_precision('{p}')", p != "highest", p)
       for p in ("highest", "high", "medium")},
}
# what our code does, each followed by the state it must leave: None = the start's own
TF32_ACTIONS = {
    **{f"--precision {p}": (f"steps.precision(argparse.Namespace(precision='{p}', amp=False), torch.device('cpu'))",
                            p == "tf32") for p in ("fp32", "tf32", "bf16", "fp16")},
    "kernel guard": ("with ssm.full_fp32_matmuls(): inside.append(state())", None),
    "nested kernel guards": ("with ssm.full_fp32_matmuls():\n"
                             "    with ssm.full_fp32_matmuls(): inside.append(state())\n"
                             "    inside.append(state())", None),
    "kernel guard left by an exception": ("try:\n"
                                          "    with ssm.full_fp32_matmuls(): inside.append(state()); 1 / 0\n"
                                          "except ZeroDivisionError: pass", None),
    "ssm.Matmul forward + backward": ("a = torch.randn(3, 3, requires_grad=True)\n"
                                      "ssm.Matmul.apply(a, a).sum().backward()", None),
    "--precision tf32 then the kernel guard": (
        "steps.precision(argparse.Namespace(precision='tf32', amp=False), torch.device('cpu'))\n"
        "with ssm.full_fp32_matmuls(): inside.append(state())", True),
    "bench's unguarded kernel (TF32 allowed, restored)": (
        "old = ssm.set_matmul_precision('high'); inside.append(None); ssm.set_matmul_precision(old)", None),
}
# each case in a child forked from a fresh interpreter (torch's TF32 state is per process and remembers which API
# set it), results as JSON lines
TF32_CHILD = r'''
import argparse, json, os, sys
import torch
import ssm
from lab import steps
cases = json.loads(sys.stdin.read())
if os.environ.get("HIDE_NEW_TF32_API"):            # a torch without fp32_precision (< 2.9)
    real = torch.backends.cuda.matmul
    class Legacy:
        def __getattr__(self, name):
            if name == "fp32_precision":
                raise AttributeError(name)
            return getattr(real, name)
        def __setattr__(self, name, value):
            if name == "fp32_precision":
                raise AttributeError(name)
            setattr(real, name, value)
    torch.backends.cuda.matmul = Legacy()
def state():
    out = {}
    for name, get in [("cublas", torch._C._get_cublas_allow_tf32),
                      ("allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                      ("precision", torch.get_float32_matmul_precision)]:
        try:
            out[name] = get()
        except Exception as e:
            out[name] = "raised: " + str(e).splitlines()[0][:100]
    return out
for start, action in cases:
    r, w = os.pipe()
    if os.fork() == 0:
        inside = []
        exec(start)
        exec(action)
        os.write(w, json.dumps(dict(after=state(), inside=[s for s in inside if s])).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        print(f.read(), flush=True)
    os.wait()
'''


def tf32_states(starts, hide_new_api=False):
    """{(start, action): {"after": getters, "inside": getters inside the guard}} from TF32_CHILD."""
    import json
    import subprocess
    import sys
    cases = [(TF32_STARTS[s][0], TF32_ACTIONS[a][0]) for s in starts for a in TF32_ACTIONS]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", **({"HIDE_NEW_TF32_API": "1"} if hide_new_api else {})}
    done = subprocess.run([sys.executable, "-c", TF32_CHILD], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(cases), done.stderr[-2000:]
    return dict(zip([(s, a) for s in starts for a in TF32_ACTIONS], map(json.loads, lines)))


def assert_tf32_states(states):
    for (start, action), got in states.items():
        _, start_tf32, start_precision = TF32_STARTS[start]
        want = TF32_ACTIONS[action][1]
        tf32 = start_tf32 if want is None else want
        where = f"after `{start}`, then {action}"
        for seen in [got["after"], *got["inside"]]:
            raised = {k: v for k, v in seen.items() if isinstance(v, str) and v.startswith("raised")}
            assert not raised, f"{where}: torch's TF32 getters raised: {raised}"
        assert got["after"]["cublas"] is tf32 and got["after"]["allow_tf32"] is tf32, \
            f"{where}: cuBLAS's TF32 is {got['after']['cublas']}, asked {tf32}"
        if want is None:
            assert got["after"]["precision"] == start_precision, f"{where}: precision not restored: {got['after']}"
        assert all(s["cublas"] is False for s in got["inside"]), f"{where}: TF32 on inside the guard: {got['inside']}"


def test_tf32_getters_answer_and_hold_the_flag_asked_after_every_setter_of_ours_from_every_starting_state():
    # torch >= 2.9: the new API's fp32_precision = "tf32" alone leaves cuBLAS's own query raising ("mix of the legacy
    # and new APIs"); the legacy allow_tf32 = False after set_float32_matmul_precision("high") leaves
    # get_float32_matmul_precision() raising: ours must leave every getter readable, whatever came before
    starts = [s for s in TF32_STARTS if "fp32_precision =" not in s or
              hasattr(torch.backends.cuda.matmul, "fp32_precision")]
    assert_tf32_states(tf32_states(starts))


def test_tf32_setters_work_on_a_torch_without_the_new_fp32_precision_api():
    starts = [s for s in TF32_STARTS if "fp32_precision =" not in s]      # what a torch < 2.9 offers
    assert_tf32_states(tf32_states(starts, hide_new_api=True))


# ---- each SSM kernel once per evaluation pass

def counted_kernels(model):
    """Wrap every layer's kernel forward to count its calls -> the list of lengths it was called with."""
    calls = []
    for layer in model.layers:
        forward = layer.kernel.forward
        layer.kernel.forward = lambda L, forward=forward: calls.append(L) or forward(L)
    return calls


@over_kernels
def test_an_evaluation_pass_computes_each_kernel_once_per_length_and_gives_the_uncached_outputs(name):
    torch.manual_seed(0)
    Config, _, Backbone = KERNELS[name][:3]
    model = Backbone(config(name, d_model=8, n_layers=2, vocab_size=20)).eval()
    reference = copy.deepcopy(model)
    batches = [torch.randint(1, 20, (3, L)) for L in (32, 32, 48, 32)]
    calls = counted_kernels(model)
    with torch.no_grad():
        cached = [model(x) for x in batches]
        plain = [torch.stack([reference(x[i:i + 1])[0] for i in range(3)]) for x in batches]  # a new pass each row
    assert sorted(calls) == [32, 32, 48, 48], f"kernel calls per layer and length: {calls}"
    for c, p in zip(cached, plain):
        torch.testing.assert_close(c, p, rtol=0, atol=1e-6, msg="cached kernels changed the outputs")


@over_kernels
def test_the_kernel_is_recomputed_after_a_weight_is_written_or_the_mode_changes_and_always_in_training(name):
    torch.manual_seed(0)
    Backbone = KERNELS[name][2]
    model = Backbone(config(name, d_model=8, n_layers=1, vocab_size=20)).eval()
    x = torch.randint(1, 20, (2, 16))
    calls = counted_kernels(model)
    with torch.no_grad():
        before = model(x)
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(state)                       # written in place, still in eval mode
        after = model(x)
        fresh = Backbone(config(name, d_model=8, n_layers=1, vocab_size=20))
        fresh.load_state_dict(state)
        torch.testing.assert_close(after, fresh.eval()(x), rtol=0, atol=1e-6)
        assert not torch.equal(before, after) and calls == [16, 16], calls
        model.eval()                                       # a new pass
        model(x)
    assert calls == [16, 16, 16], calls
    model(x)                                               # eval mode with autograd: every call
    model.train()
    with torch.no_grad():
        model(x), model(x)
    assert calls == [16] * 6, f"outside eval + no_grad the kernel must be computed each call: {calls}"
