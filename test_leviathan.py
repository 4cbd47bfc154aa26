"""What leviathan.py promises, in its order: python -m pytest -q test_leviathan.py (CPU, no network).

    LEV          LEV against the method written out, and its fast path against both
    the model    the backbone, the three arms, the loss, torch.compile
    generation   the KV cache, the context policy, the sampling filters, the frozen LEV table
The tests of LEV's kernels (host waits, Fused, Triton's interpreter) and of the scripts (data, training,
sampling, the research tools) are in tests/.
"""
import dataclasses
import functools
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import leviathan
from leviathan import (EMBEDDINGS, LEV, Config, Model, SeparableProduct, bspline_nonzero, generate_text, lev_base, sample_next,
                       to_digits)

# ---------------------------------------------------------------------------- shared helpers

# A model small enough to train in seconds, with every arm's machinery in place. Its tokenizer
# (META) is o200k truncated to 300 ids, so ids 300..383 are the padding rows of a 384-id model.
MICRO = Config(vocab_size=384, d_model=64, n_layer=2, n_head=4, seq_len=32,
               lev_seed_dim=16, lev_heads=2, lev_knots=8, lev_rank=8)
META = {"tokenizer": "o200k_base", "tokenizer_vocab_size": 300, "vocab_size": 300, "eot_id": 299}
N_VALID, EOT = 300, 299


def micro_model(embedding, seed=0, **overrides):
    torch.manual_seed(seed)
    return Model(Config(**{**MICRO.__dict__, "embedding": embedding, **overrides}))


def random_model(embedding="lev", seed=0, **overrides):
    """A micro model in eval mode whose greedy choices depend on its input: the untied head starts
    at zero (every logit equal), so it is re-drawn, and the backbone gets unit-gain weights."""
    model = micro_model(embedding, seed, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.startswith("lev."):
                torch.nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))
    return model.eval()


# ---------------------------------------------------------------------------- LEV


def lev_param_formula(V, D, k=3, d_seed=128, h=8, kappa=16, r=64):
    b = lev_base(V, k)
    return k * b * d_seed + h * d_seed**2 + 2 * h * d_seed + h * d_seed * kappa * r + h * r * D


@pytest.mark.parametrize("V", [27, 28, 8192, 200_064])
def test_digits_are_a_bijection(V):
    b = lev_base(V, 3)
    assert b**3 >= V > (b - 1) ** 3  # the smallest base that fits
    digits = to_digits(torch.arange(V), b, 3)
    assert digits.min() >= 0 and digits.max() < b
    rebuilt = (digits * torch.tensor([b * b, b, 1])).sum(-1)
    assert torch.equal(rebuilt, torch.arange(V))  # injective and onto [0, V)


def test_lev_base_matches_the_paper():
    assert lev_base(200_376, 3) == 59 and lev_base(200_019, 3) == 59


def beta(x):
    """The centred quadratic B-spline, as the method writes it (README)."""
    x = x.abs()
    return torch.where(x < 0.5, 0.75 - x**2, torch.where(x < 1.5, 0.5 * (1.5 - x) ** 2, 0.0))


def method_basis(t, knots):
    """Step 3c as the method writes it: beta on every knot, normalised to sum to one. [...] -> [..., kappa]."""
    raw = beta((t[..., None] - torch.linspace(0, 1, knots, dtype=t.dtype)) * (knots - 1))
    return raw / raw.sum(-1, keepdim=True)


def test_bspline_nonzero_is_the_normalised_formula():
    knots = 16
    t = torch.cat([torch.linspace(0, 1, 10_001), torch.tensor([0.5, 1 / 15, 14 / 15, 0.5 / 15])])
    t = t.double().requires_grad_()
    index, values, slopes = (plane.T for plane in bspline_nonzero(t.detach(), knots))  # [len(t), 3]
    index = index.long()  # int32 from LEV (half the memory); scatter_add takes int64
    basis = torch.zeros(len(t), knots, dtype=t.dtype).scatter_add(-1, index, values)
    expected = method_basis(t, knots)
    assert torch.allclose(basis, expected, atol=1e-12)
    assert (values >= 0).all() and (index >= 0).all() and (index < knots).all()
    assert torch.allclose(basis.sum(-1), torch.ones_like(t), atol=1e-12)
    raw = beta((t.detach()[:, None] - torch.linspace(0, 1, knots, dtype=torch.double)) * (knots - 1))
    inner = (t > 1.5 / 15) & (t < 13.5 / 15)  # all three knots exist: normalising changes nothing
    assert torch.allclose(basis[inner], raw[inner], atol=1e-12)
    assert raw.sum(-1).min() == pytest.approx(0.875, abs=1e-3)  # but near the ends it does
    # the slopes are dB_m/dt of the normalised basis, as autograd finds them
    slope_basis = torch.zeros_like(basis).scatter_add(-1, index, slopes)
    jacobian = torch.stack([torch.autograd.grad(expected[:, m].sum(), t, retain_graph=True)[0]
                            for m in range(knots)], -1)
    assert torch.allclose(slope_basis, jacobian, atol=1e-9)


def method_reference(lev, ids):
    """LEV written the slow, obvious way: one id and one head at a time (the method's steps 1-4)."""
    out = []
    for i in ids.tolist():
        digits = [(i // lev.base ** (lev.digits - 1 - j)) % lev.base for j in range(lev.digits)]
        z = sum(lev.codebooks[j, digits[j]] for j in range(lev.digits))
        E = 0
        for l in range(lev.seed_proj.shape[0]):
            u = torch.nn.functional.layer_norm(z @ lev.seed_proj[l], z.shape, lev.norm_weight[l],
                                               lev.norm_bias[l], 1e-5)
            phi = torch.einsum("dk,dkr->dr", method_basis(torch.sigmoid(u / 2), lev.knots), lev.spline[l])
            E = E + phi.prod(0) @ lev.out_proj[l]
        out.append(E)
    return torch.stack(out)


def test_lev_matches_the_method_written_out():
    torch.manual_seed(0)
    lev = LEV(1000, 32, seed_dim=24, heads=3, knots=10, rank=6).double()
    with torch.no_grad():
        lev.spline.normal_(1.0, 0.5)  # make some factors negative: the sign parity matters
    ids = torch.tensor([0, 1, 9, 10, 99, 100, 500, 999])
    expected = method_reference(lev, ids)
    assert torch.allclose(lev.generate_reference(ids), expected, atol=1e-12)
    assert torch.allclose(lev.generate(ids), expected, atol=1e-12)


def random_lev(seed, **sizes):
    """A LEV with random (not initial) parameters: large LayerNorm biases push many t_d to
    the end knots, and S = N(1, 0.5) makes some phi_d negative."""
    torch.manual_seed(seed)
    lev = LEV(8192, 48, **sizes)
    with torch.no_grad():
        lev.codebooks.normal_(0, 1.0)
        lev.seed_proj.normal_(0, lev.seed_proj.shape[-1] ** -0.5)
        lev.norm_weight.normal_(1.0, 0.5)
        lev.norm_bias.normal_(0, 3.0)
        lev.spline.normal_(1.0, 0.5)
        lev.out_proj.normal_(0, 0.1)
    return lev


@pytest.mark.parametrize("per_chunk, fused", [(20, True), (3, True), (1, True), (3, False)])
def test_fast_lev_matches_the_reference_in_value_and_gradient(monkeypatch, per_chunk, fused):
    """generate() against generate_reference() in float32 on random parameters, with ids
    whose t_d reach both end knots and products with negative factors. d_seed = 20: groups
    of 10 factors; backward chunks of 20 coordinates, 3 (the last of 2) or 1."""
    ids = torch.cat([torch.arange(40), torch.randint(40, 8192, (200,), generator=torch.Generator().manual_seed(0))])
    ids = ids.unique()
    monkeypatch.setattr(leviathan, "CHUNK_FLOATS_CPU", per_chunk * 3 * len(ids) * 8)  # h = 3, r = 8
    monkeypatch.setattr(leviathan, "FUSE_MIN_FLOATS", 0 if fused else 1 << 40)
    seen = {}

    def recording(t, spline):
        seen["t"], seen["modes"] = t.detach(), leviathan.SeparableProduct.apply(t, spline)
        return seen["modes"]

    monkeypatch.setattr(leviathan, "separable_modes", recording)
    lev = random_lev(0, seed_dim=20, heads=3, knots=16, rank=8)
    assert len(leviathan.seed_chunks(torch.empty(20, 3, len(ids)), 8)) == -(-20 // per_chunk)
    weights = torch.randn(len(ids), 48)
    fast = lev.generate(ids)
    position = seen["t"] * (lev.knots - 1)
    assert (position < 0.5).any() and (position > lev.knots - 1.5).any()  # both end knots in use
    assert (seen["modes"] < 0).any()  # an odd number of negative phi_d somewhere
    slow = lev.generate_reference(ids)
    assert (fast - slow).abs().max() <= 1e-5 * slow.abs().max()
    grads_fast = torch.autograd.grad((fast * weights).sum(), list(lev.parameters()))
    grads_slow = torch.autograd.grad((slow * weights).sum(), list(lev.parameters()))
    for (name, _), g_fast, g_slow in zip(lev.named_parameters(), grads_fast, grads_slow):
        assert (g_fast - g_slow).abs().max() <= 1e-5 * g_slow.abs().max(), name


def test_separable_product_gradient(monkeypatch):
    monkeypatch.setattr(leviathan, "CHUNK_FLOATS_CPU", 20)  # chunks of 2 coordinates, the last of 1
    torch.manual_seed(0)
    t = torch.rand(5, 2, 3, dtype=torch.double)
    t[0, 0] = torch.tensor([0.0, 1.0, 0.02])  # at and near the end knots
    t.requires_grad_()
    spline = torch.randn(2, 5, 4, 3, dtype=torch.double, requires_grad=True)  # mixed signs
    assert torch.autograd.gradcheck(SeparableProduct.apply, (t, spline))


@pytest.mark.parametrize("first, then", [(1e30, 1e-30), (1e-30, 1e30)])
def test_product_is_exact_where_a_plain_float32_product_is_not(first, then):
    """Six factors of 1e30 then six of 1e-30 (or the reverse) overflow (underflow) a plain float32
    product on the way, although the whole product is near 1; carried as mantissa and exponent,
    SeparableProduct's product stays exact, as it does for factors near 1. S is constant along
    the knots, so phi_d = S_l[d, 0] whatever t is."""
    near_one = 1 + 0.3 * torch.randn(12, 2, 4, generator=torch.Generator().manual_seed(0))  # [d, h, r]
    wild = near_one * torch.tensor([first] * 6 + [then] * 6).view(12, 1, 1)
    assert not torch.isfinite(wild.prod(0)).all() or (wild.prod(0) == 0).all()  # the plain product fails
    t = torch.rand(12, 2, 5)
    for phi in (near_one, wild):
        spline = phi.transpose(0, 1)[:, :, None, :].expand(2, 12, 6, 4).contiguous()  # [h, d, kappa, r]
        modes = SeparableProduct.apply(t, spline)
        expected = phi.double().prod(0)[:, None, :].expand(2, 5, 4)
        torch.testing.assert_close(modes.double(), expected, rtol=1e-6, atol=0)


def test_compiled_generator_keeps_the_product_eager():
    """Under torch.compile the product stays one opaque call, so no traced backward can
    swap its recomputation of phi for a saved copy."""
    torch._dynamo.reset()
    graphs = []

    def capturing_backend(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    lev = random_lev(0, seed_dim=16, heads=2, knots=8, rank=8)
    ids = torch.arange(50)
    expected = lev.generate(ids)
    leviathan.compile_lev(lev, backend=capturing_backend)
    assert torch.allclose(lev.generate(ids), expected, atol=1e-6)
    assert graphs and not any("frexp" in code for code in graphs)


def test_lev_generates_a_bucket_of_rows_and_the_extra_rows_change_nothing(monkeypatch):
    """LEV.forward generates distinct_ids' rows: for n distinct ids a bucket of at most 25% more, 4
    sizes per doubling; the output and every gradient are those of generating exactly the n rows."""
    def bucket(n):
        return len(leviathan.distinct_ids(torch.arange(n))[0])

    assert [bucket(n) for n in (1, 8, 9, 100, 1025, 3900)] == [1, 8, 10, 112, 1280, 4096]
    assert all(n <= bucket(n) <= 1.25 * n for n in range(1, 5000))
    assert len({bucket(n) for n in range(1025, 2049)}) == 4
    lev = micro_model("lev").lev
    generated, generate = [], lev.generate
    monkeypatch.setattr(lev, "generate", lambda rows: generated.append(len(rows)) or generate(rows))
    for n in (37, 300):
        ids = torch.randperm(MICRO.vocab_size)[:n].repeat(3)  # n distinct ids, each 3 times
        weights = torch.randn(len(ids), MICRO.d_model)
        out = lev(ids)
        grads = torch.autograd.grad((out * weights).sum(), list(lev.parameters()))
        unique, inverse = torch.unique(ids, return_inverse=True)
        exact = F.embedding(inverse, generate(unique))
        exact_grads = torch.autograd.grad((exact * weights).sum(), list(lev.parameters()))
        assert generated[-1] == bucket(n) > n
        torch.testing.assert_close(out, exact, rtol=1e-6, atol=1e-7)
        for g, ref in zip(grads, exact_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_lev_parameter_count():
    with torch.device("meta"):
        paper = LEV(200_376, 2048)
        small = LEV(8192, 128, seed_dim=32, heads=4, knots=8, rank=16)
    assert sum(p.numel() for p in paper.parameters()) == 2_252_928
    assert sum(p.numel() for p in paper.parameters()) == lev_param_formula(200_376, 2048)
    assert sum(p.numel() for p in small.parameters()) == lev_param_formula(8192, 128, 3, 32, 4, 8, 16)
    shapes = {n: tuple(p.shape) for n, p in paper.named_parameters()}
    assert shapes == {"codebooks": (3, 59, 128), "seed_proj": (8, 128, 128), "norm_weight": (8, 128),
                      "norm_bias": (8, 128), "spline": (8, 128, 16, 64), "out_proj": (8, 64, 2048)}


def test_lev_under_bf16_autocast():
    torch.manual_seed(0)
    lev = LEV(8192, 128)
    ids = torch.randint(0, 8192, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        E = lev(ids)
    assert E.shape == (2, 7, 128)
    assert E.dtype == torch.float32  # computed in float32 like an nn.Embedding lookup
    assert torch.equal(E, lev(ids))  # autocast changes nothing inside LEV


def test_lev_init_scale():
    """The (R) init keeps M_l = prod of 128 factors near 1: E is finite, of moderate size,
    and different tokens get clearly different vectors."""
    torch.manual_seed(0)
    E = LEV(8192, 128).generate(torch.arange(8192))
    assert torch.isfinite(E).all()
    assert 0.05 < E.std().item() < 0.5
    assert 0.05 < (E - E.mean(0)).std().item() < 0.5  # the part that differs between ids


def test_unique_then_gather_equals_per_position():
    torch.manual_seed(0)
    lev = LEV(500, 32, seed_dim=16, heads=2, knots=8, rank=8)
    ids = torch.randint(0, 40, (3, 50))  # many repeats
    E = lev(ids)
    E_each = torch.stack([lev.generate(row) for row in ids])  # one evaluation per position
    assert torch.allclose(E, E_each, atol=1e-6)
    weights = torch.randn_like(E)
    grads = torch.autograd.grad((E * weights).sum(), list(lev.parameters()))
    grads_each = torch.autograd.grad((E_each * weights).sum(), list(lev.parameters()))
    for g, g_each in zip(grads, grads_each):
        assert torch.allclose(g, g_each, atol=1e-5, rtol=1e-4)


def test_gradients_reach_every_lev_parameter():
    model = micro_model("lev")
    torch.nn.init.normal_(model.head.weight, std=0.02)  # the zero-init head would block them
    idx = torch.randint(0, MICRO.vocab_size, (2, 16))
    model(idx, idx).backward()
    for name, p in model.lev.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------- the model


def test_tied_arm_shares_one_tensor():
    tied, untied = micro_model("tied"), micro_model("untied")
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    assert n_tied == tied.param_counts()["total"]
    assert untied.param_counts()["total"] - n_tied == MICRO.vocab_size * MICRO.d_model


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_causality(embedding):
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.02)
    idx = torch.randint(0, MICRO.vocab_size, (1, 20))
    t = 9
    changed = idx.clone()
    changed[0, t + 1:] = (changed[0, t + 1:] + 1) % MICRO.vocab_size
    logits, logits_changed = model(idx), model(changed)
    assert torch.allclose(logits[0, :t + 1], logits_changed[0, :t + 1], atol=1e-6)
    assert not torch.allclose(logits[0, t + 1], logits_changed[0, t + 1])


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_kv_cache_gives_the_same_logits(embedding):
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.02)
    idx = torch.randint(0, MICRO.vocab_size, (2, 12))
    full = model(idx)
    cache = model.new_cache(batch=2)
    stepwise = [model(idx[:, :5], cache=cache)]  # prefill 5 tokens, then one at a time
    stepwise += [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
    assert torch.allclose(torch.cat(stepwise, 1), full, atol=1e-5)


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_micro_model_overfits_a_fixed_batch(embedding):
    model = micro_model(embedding)
    # 3e-3, not 1e-2: LEV's product of d_seed factors turns large Adam steps into
    # loss spikes (at 1e-2 it reaches ~1.3, then jumps back to ~2.3).
    opt = model.configure_optimizers(lr=3e-3, weight_decay=0.0)
    torch.manual_seed(1)
    batch = torch.randint(0, MICRO.vocab_size, (4, MICRO.seq_len + 1))
    for step in range(120):
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 1.0, f"{embedding}: loss {loss.item():.3f} after {step + 1} steps"


def test_optimizer_groups_scale_lr_and_spare_the_input_side_from_decay():
    for embedding in EMBEDDINGS:
        model = micro_model(embedding)
        groups = model.configure_optimizers(lr=1e-3, weight_decay=0.1, lr_input=0.25, lr_head=8.0).param_groups
        group_of = {id(p): g for g in groups for p in g["params"]}
        assert len(group_of) == sum(1 for _ in model.parameters())  # every parameter exactly once
        for g in groups:
            assert g["lr"] == pytest.approx(1e-3 * g["lr_scale"])
        backbone = group_of[id(model.blocks[0].mlp.down.weight)]
        assert backbone["lr_scale"] == 1.0 and backbone["weight_decay"] == 0.1
        assert group_of[id(model.norm.weight)]["weight_decay"] == 0.0
        head = group_of[id(model.head.weight)]
        inputs = list(model.lev.parameters()) if embedding == "lev" else [model.embed.weight]
        for p in inputs:
            assert group_of[id(p)]["lr_scale"] == 0.25
            # decay would shrink LEV's product of 128 factors; the tied table is the head too
            assert group_of[id(p)]["weight_decay"] == (0.1 if embedding == "tied" else 0.0)
        assert head["weight_decay"] == 0.1 and head["lr_scale"] == (0.25 if embedding == "tied" else 8.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunked_loss_equals_its_reference(reduction, monkeypatch):
    """linear_cross_entropy never builds the [N, V] logits, yet gives what cross_entropy_reference
    (F.cross_entropy on them) gives: the loss, and dL/dx and dL/dW under a gradient from above
    that is not 1 (the mean's backward scales by it). 7 positions per chunk: 50 positions make 8
    chunks, the last of 1."""
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", 7 * MICRO.vocab_size)
    assert [c.stop - c.start for c in leviathan.loss_chunks(50, MICRO.vocab_size)] == [7] * 7 + [1]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=generator, requires_grad=True)
    weight = (0.3 * torch.randn(MICRO.vocab_size, 16, generator=generator)).requires_grad_()
    targets = torch.randint(0, MICRO.vocab_size, (50,), generator=generator)
    from_above = torch.tensor(3.0) if reduction == "mean" else torch.rand(50, generator=generator)
    results = []
    for loss_fn in (leviathan.linear_cross_entropy, leviathan.cross_entropy_reference):
        loss = loss_fn(x, weight, targets, reduction=reduction)
        results.append((loss, *torch.autograd.grad(loss, (x, weight), from_above)))
    (loss, grad_x, grad_w), (reference, reference_x, reference_w) = results
    assert loss.shape == reference.shape == ((50,) if reduction == "none" else ())
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for g, ref in [(grad_x, reference_x), (grad_w, reference_w)]:  # to float32 rounding
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("embedding", ["tied", "lev"])
def test_model_loss_is_the_cross_entropy_of_its_logits(embedding, monkeypatch):
    """Model.forward's chunked loss against F.cross_entropy on the model's own logits: the value,
    every parameter's gradient (the tied table gets both of its gradients), per-token losses in
    [B, T], and under bf16 autocast a float32 loss. 7 positions per chunk, as above."""
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", 7 * MICRO.vocab_size)
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.1)
    idx, targets = torch.randint(0, MICRO.vocab_size, (2, 2, 25))
    loss = model(idx, targets)
    grads = torch.autograd.grad(3 * loss, list(model.parameters()))
    reference = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    reference_grads = torch.autograd.grad(3 * reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for g, ref in zip(grads, reference_grads):  # to float32 rounding, relative to each tensor's scale
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    per_token = F.cross_entropy(model(idx).transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(model(idx, targets, reduction="none"), per_token, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CUDA path's dtype, run on the CPU
        bf16_loss = model(idx, targets)
    assert bf16_loss.dtype == torch.float32 and abs(bf16_loss.item() - reference.item()) < 0.02


class ShapeCensus(TorchDispatchMode):
    """The ops that make a tensor of one shape, by name."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.ops = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.ops.append(func.__name__)
        return out


def test_the_loss_backward_makes_no_zeros_for_its_unused_outputs():
    """Backward only scales the gradients forward made: it must not be handed a [V, D] of zeros for
    the op's gradient outputs, which nothing downstream uses."""
    x, w = torch.randn(64, 16, requires_grad=True), torch.randn(1000, 16, requires_grad=True)
    loss = leviathan.linear_cross_entropy(x, w, torch.randint(0, 1000, (64,)))
    with ShapeCensus(w.shape) as census:
        loss.backward()
    assert not [op for op in census.ops if op.startswith(("zeros", "full", "fill"))], census.ops


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors made under this mode held at once (each storage counted once,
    until it is freed; views of the inputs not counted): what a loss holds in flight, on a CPU."""

    def __init__(self, *inputs):
        super().__init__()
        self.live, self.peak = {}, 0
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: (ref, size) for ptr, (ref, size) in self.live.items() if ref() is not None}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.inputs:
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (weakref.ref(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_holds_one_chunk_of_logits_at_a_time(monkeypatch, dtype):
    """In flight inside the loss: its outputs (dL/dx, a float32 dL/dW), the head cast to dtype, one
    [V, D] product for dL/dW (bf16 only), and one chunk's logits in dtype (then G, in place) with
    their float32 copy when dtype is bf16, however many chunks there are."""
    n, V, D, chunk = 96, 4096, 8, 16  # the [chunk, V] tensors outweigh the [V, D] ones
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", chunk * V)  # 6 chunks
    x, w, targets = torch.randn(n, D), torch.randn(V, D), torch.randint(0, V, (n,))
    with LiveBytes(x, w, targets) as tracker:  # the op's body: under the op, the mode would see one call
        leviathan.chunked_loss(x, w, targets, dtype, True)
    size = torch.finfo(dtype).bits // 8
    outputs, head = n * D * 4 + V * D * 4, (V * D * size if dtype != torch.float32 else 0)
    product = V * D * size if dtype != torch.float32 else 0
    one_chunk = chunk * V * (4 + (size if dtype != torch.float32 else 0))
    assert tracker.peak <= outputs + head + product + one_chunk + 64 * chunk * D, tracker.peak
    assert tracker.peak >= outputs + one_chunk  # it did measure the chunk


def test_dl_dw_is_added_into_float32_in_place_where_torch_adds_it_right(monkeypatch):
    """Under bf16 each chunk's G^T x goes into the float32 dL/dW by torch.addmm's out_dtype
    where the probe finds it right (CUDA in recent torch; emulated here), else it is made apart
    (this CPU; or an addmm that drops the sum so far): the same gradients either way. Under
    autocast, as training calls the loss: the probe's own product must not be made in bf16."""
    n, V, D, chunk = 96, 512, 8, 16
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", chunk * V)  # 6 chunks
    x, w, targets = torch.randn(n, D), torch.randn(V, D), torch.randint(0, V, (n,))
    probe = leviathan.adds_bf16_products_into_float32.__wrapped__
    real_addmm, calls = torch.addmm, []

    def emulated_addmm(keeps_the_sum):
        def addmm(total, m1, m2, *, out_dtype, out):
            calls.append(out_dtype)
            with torch.autocast("cpu", enabled=False):  # a kernel with out=: autocast casts nothing
                return out.copy_((total if keeps_the_sum else 0) + m1.float() @ m2.float())
        return addmm
    results = {}
    cases = {"this CPU": real_addmm, "out_dtype": emulated_addmm(True),
             "wrong": emulated_addmm(False)}
    for case, addmm in cases.items():
        calls.clear()
        monkeypatch.setattr(torch, "addmm", addmm)
        fresh_probe = functools.cache(probe)  # not the answer an earlier case left
        monkeypatch.setattr(leviathan, "adds_bf16_products_into_float32", fresh_probe)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[case] = leviathan.chunked_loss(x, w, targets, torch.bfloat16, True)
        results[case + " calls"] = len(calls)
    calls_made = (results["this CPU calls"], results["out_dtype calls"], results["wrong calls"])
    assert calls_made == (0, 1 + n // chunk, 1)  # the probe's, and one a chunk where it passed
    for case in ("out_dtype", "wrong"):
        for got, want in zip(results[case], results["this CPU"], strict=True):  # to bf16's rounding
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


class LogitPasses(TorchDispatchMode):
    """The ops that read or write a tensor of one chunk's logits ([chunk, V] or its transpose),
    by name, outside the spans where `paused` is set; views move no data and are not counted."""

    def __init__(self, shape):
        super().__init__()
        self.shapes, self.ops, self.paused = {tuple(shape), tuple(shape)[::-1]}, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
        if not self.paused and not func.is_view and any(tuple(t.shape) in self.shapes for t in tensors):
            self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_passes_over_the_logits_once_outside_its_fused_step(monkeypatch, dtype):
    """On the GPU's path, a chunk's [chunk, V] logits are touched by three ops outside the softmax
    step: the head's matmul that writes z, and the two matmuls that read G. The step itself (here
    run plain, uncounted) is fused there: test_fused_kernels_match_eager_as_triton_kernels."""
    n, V, D, chunk = 96, 4096, 8, 32
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", chunk * V)  # 3 chunks
    census, steps, softmax_step = LogitPasses((chunk, V)), [], leviathan.softmax_gradient_

    def uncounted_step(*args):
        census.paused = True
        steps.append(softmax_step(*args))
        census.paused = False
        return steps[-1]

    monkeypatch.setattr(leviathan, "softmax_gradient_", uncounted_step)  # a CPU's softmax step
    x, w, targets = torch.randn(n, D), torch.randn(V, D), torch.randint(0, V, (n,))
    with census:
        leviathan.chunked_loss(x, w, targets, dtype, True)
    assert len(steps) == n // chunk
    assert len(census.ops) == 3 * len(steps), census.ops


def test_compiler_sees_the_loss_as_one_opaque_call(monkeypatch):
    """torch.compile's graph holds the chunked loss as one call of its custom operator, however
    many chunks it makes: traced instead, the chunk loop would be unrolled into the graph and
    inductor would keep each chunk's [V, D] partial of dL/dW. Gradients equal eager's."""
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", 7 * MICRO.vocab_size)  # 8 chunks
    torch._dynamo.reset()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    x, weight = torch.randn(50, 16, requires_grad=True), torch.randn(MICRO.vocab_size, 16, requires_grad=True)
    targets = torch.randint(0, MICRO.vocab_size, (50,))
    compiled = torch.compile(leviathan.linear_cross_entropy, backend=recording_backend, fullgraph=True)
    grads = torch.autograd.grad(compiled(x, weight, targets), (x, weight))
    calls = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert calls.count(torch.ops.leviathan.chunked_cross_entropy.default) == 1
    assert len(calls) == 2, calls  # the operator and taking the loss out of its outputs: nothing else
    for g, ref in zip(grads, torch.autograd.grad(leviathan.linear_cross_entropy(x, weight, targets), (x, weight))):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_compiled_model_does_not_recompile_when_distinct_ids_change():
    """Model.compile: LEV's torch.unique stays outside the compiled graph and its generator is
    compiled with a dynamic N, so batches with different numbers of distinct ids reuse the graphs."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = micro_model("lev")
    model.compile(backend=counting_backend)
    assert model.state_dict().keys() == micro_model("lev").state_dict().keys()  # compiled in place
    counts = []
    for n_distinct in (5, 17, 40, 64):
        idx = torch.arange(2 * MICRO.seq_len).view(2, -1) % n_distinct  # n_distinct ids
        loss = model(idx, idx)
        loss.backward()
        counts.append(len(graphs))
    assert counts[0] > 0
    assert counts[1:] == counts[:1] * 3, f"graphs compiled after each batch: {counts}"
    # Handed distinct_ids (training), the rows' number is an input of the graph before LEV: its
    # second size makes it dynamic, one graph more, and then no more
    for n_distinct in (5, 17, 40, 64, 100):
        idx = torch.arange(2 * MICRO.seq_len).view(2, -1) % n_distinct
        model(idx, idx, distinct=leviathan.distinct_ids(idx)).backward()
        counts.append(len(graphs))
    assert counts[5] <= counts[4] + 1 and counts[5:] == counts[5:6] * 4, f"graphs compiled after each batch: {counts}"


def test_config_refuses_every_out_of_range_field():
    bad = dict(vocab_size=1, d_model=0, n_layer=0, n_head=0, seq_len=0, embedding="sparse", rope_theta=0.0,
               lev_digits=0, lev_seed_dim=1, lev_heads=0, lev_knots=2, lev_rank=0, lev_sigmoid_scale=0.0)
    assert set(bad) == {f.name for f in dataclasses.fields(Config)}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            Model(Config(**{**MICRO.__dict__, name: value}))


def test_config_refuses_an_infinite_rotary_base():
    for theta in (math.inf, math.nan):
        with pytest.raises(ValueError, match="rope_theta"):
            Config(**{**MICRO.__dict__, "rope_theta": theta})


def test_a_temperature_so_small_that_the_scaled_logits_overflow_samples_the_argmax():
    """z / T beyond float32 (T = 1e-40): the limit of sampling as T -> 0 is the greedy choice, with
    or without the top-k and nucleus filters, not softmax's nan."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 10
    for temperature in (1e-38, 1e-40, 1e-45):
        for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.5), (5, 1e-30)]:
            assert sample_next(logits, temperature, top_k, top_p, torch.Generator()) == int(logits.argmax())


def test_config_refuses_digits_that_are_always_zero():
    """8,192 ids have 13 binary digits: a 14th (leading) digit would be 0 for every id."""
    assert LEV.from_config(Config(vocab_size=8192, lev_digits=13)).base == 2
    for digits in (14, 40):
        with pytest.raises(ValueError, match=f"lev_digits={digits}: 8,192 ids have fewer than {digits} digits in "
                                             "base 2 "):
            Config(vocab_size=8192, lev_digits=digits)
    assert Config(vocab_size=200_064, lev_digits=3)  # the paper's: base 59, 59^2 < V


# ---------------------------------------------------------------------------- generation


def clone(model):
    twin = Model(model.cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def generated_ids(model, new_tokens, seed=None, **kw):
    """generate_text() as a list; a fresh generator per call so that runs are comparable."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    prompt = kw.pop("prompt", [5, 17, 230, 42, 8])
    return list(generate_text(model, prompt, new_tokens, generator=gen, **kw))


def rerun_ids(model, new_tokens, seed=None, prompt=(5, 17, 230, 42, 8), **kw):
    """The reference generate_text() is held to: the whole window rerun at every step, no cache, under
    generate's context policy (a window past seq_len jumps to its last seq_len // 2 tokens)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens, start, seq_len = list(prompt), 0, model.cfg.seq_len
    for _ in range(new_tokens):
        if len(tokens) - start > seq_len:
            start = len(tokens) - seq_len // 2
        with torch.no_grad():
            logits = model(torch.tensor([tokens[start:]]))[0, -1]
        tokens.append(sample_next(logits, generator=gen, **kw))
    return tokens[len(prompt):]


def bias_logits(model, ids, amount):
    """Add `amount` to the logits of `ids` on every forward pass (a hook on the head)."""
    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., ids] += amount
        return out
    return model.head.register_forward_hook(hook)


# sample.py: generate_text()


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_cache_gives_the_same_tokens_as_rerunning_the_context(embedding):
    # 80 new tokens from a 5-token prompt in a 32-token context: the window is cut back
    # to its last 16 tokens four times. Cached path: frozen LEV table; reference: live LEV.
    fast = random_model(embedding)
    slow = clone(fast)
    fast.freeze_lev()
    greedy = generated_ids(fast, 80, temperature=0, n_valid=N_VALID)
    assert len(greedy) == 80
    assert greedy == rerun_ids(slow, 80, temperature=0, n_valid=N_VALID)
    # Greedy choices of a random model soon settle into a loop, so sampling (same seed,
    # same draws in both paths) checks the same thing on a varied sequence as well.
    sampled = generated_ids(fast, 80, seed=3, temperature=1.0, n_valid=N_VALID)
    assert len(set(sampled)) > 40
    assert sampled == rerun_ids(slow, 80, seed=3, temperature=1.0, n_valid=N_VALID)


def record_windows(model):
    """Spy on forward: returns the list of contexts the model was shown, as token lists."""
    windows, forward = [], model.forward

    def spy(idx, targets=None, cache=None):
        new = idx[0].tolist()
        if cache is None or cache[0].length == 0:
            windows.append(("full" if cache is None else "fill", new))
        else:  # a cache must hold exactly the previous window; one position is added
            assert cache[0].length == len(windows[-1][1]) and len(new) == 1
            windows.append(("step", windows[-1][1] + new))
        return forward(idx, targets, cache)
    model.forward = spy
    return windows


def test_context_cap_policy_is_the_same_as_the_reference():
    model = random_model("untied")
    twin = clone(model)
    cached, rerun = record_windows(model), record_windows(twin)
    tokens = generated_ids(model, 60, temperature=0)
    assert rerun_ids(twin, 60, temperature=0) == tokens
    history = [5, 17, 230, 42, 8] + tokens
    assert [w for _, w in cached] == [w for _, w in rerun]  # identical contexts, step by step
    for step, (_, window) in enumerate(rerun):
        assert 1 <= len(window) <= 32 and window == history[step + 5 - len(window):step + 5]
    # The prompt, and each cut back to the last 16 tokens, fill a fresh cache; every other
    # step feeds one token: 5 -> 32, 16 -> 32, 16 -> 30 tokens.
    kinds = [kind for kind, _ in cached]
    assert [i for i, k in enumerate(kinds) if k == "fill"] == [0, 28, 45]
    assert [len(cached[i][1]) for i in (0, 27, 28, 44, 45, 59)] == [5, 32, 16, 32, 16, 30]


def test_prompt_must_fit_the_context():
    model = random_model("untied")
    with pytest.raises(ValueError, match="seq_len=32"):
        generate_text(model, list(range(33)), 5)
    assert len(generated_ids(model, 3, prompt=list(range(32)), temperature=0)) == 3  # exactly full: fine


def test_same_seed_same_sample():
    model = random_model("lev")
    model.freeze_lev()
    first = generated_ids(model, 40, seed=7, temperature=1.0, top_p=0.9)
    assert first == generated_ids(model, 40, seed=7, temperature=1.0, top_p=0.9)
    assert first != generated_ids(model, 40, seed=8, temperature=1.0, top_p=0.9)


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_top_k_1_and_tiny_top_p_equal_greedy(embedding):
    model = random_model(embedding)
    greedy = generated_ids(model, 40, temperature=0, n_valid=N_VALID)
    assert generated_ids(model, 40, seed=1, temperature=1.5, top_k=1, n_valid=N_VALID) == greedy
    assert generated_ids(model, 40, seed=1, temperature=1.5, top_p=1e-6, n_valid=N_VALID) == greedy
    # a top_p so small that it is 0 in float32: the most likely id still survives the nucleus
    assert generated_ids(model, 40, seed=1, temperature=1.5, top_p=5e-324, n_valid=N_VALID) == greedy


def test_top_k_and_top_p_keep_the_right_ids():
    logits = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()
    gen = torch.Generator().manual_seed(0)

    def drawn(**kw):
        return {sample_next(logits, generator=gen, **kw) for _ in range(2000)}
    assert drawn(top_k=3) == {0, 1, 2}
    assert drawn(top_p=0.7) == {0, 1}  # 0.5 is short of 0.7, so the id that crosses it stays
    assert drawn(top_p=0.4) == {0}
    assert drawn() == {0, 1, 2, 3, 4}
    assert drawn(temperature=0, top_k=3) == {0}


def test_padding_ids_are_never_sampled():
    model = random_model("untied")
    bias_logits(model, list(range(N_VALID, 384)), 50.0)  # padding rows would always win
    assert min(generated_ids(model, 30, seed=0)) >= N_VALID  # the bias works: without the mask...
    for kw in ({"temperature": 0}, {"temperature": 2.0}, {"temperature": 1.0, "top_k": 50},
               {"temperature": 1.0, "top_p": 0.5}):
        assert max(generated_ids(model, 100, seed=0, n_valid=N_VALID, **kw)) < N_VALID, kw


def test_generation_stops_at_the_stop_id():
    model = random_model("untied")
    handle = bias_logits(model, [EOT], 50.0)
    assert generated_ids(model, 10, seed=0, stop_id=EOT) == []  # stops, and EOT is not yielded
    assert generated_ids(model, 10, seed=0) == [EOT] * 10
    handle.remove()
    free = generated_ids(model, 50, seed=0, temperature=0, stop_id=1000)
    assert len(free) == 50


# sample.py: the frozen LEV table


def test_frozen_table_equals_lev_output():
    # 20,000 ids: many 1024-id chunks of as_table(), the last one partial. Tolerance: 1e-5 absolute and
    # relative (float32; the table and LEV run the same arithmetic on different batches).
    model = random_model("lev", vocab_size=20_000)
    model.freeze_lev()
    ids = torch.arange(20_000)
    with torch.no_grad():
        live = model.lev(ids)
        one_by_one = torch.cat([model.lev(torch.tensor([i])) for i in (0, 8191, 8192, 12345, 19_999)])
    assert model.frozen_table.shape == (20_000, 64)
    torch.testing.assert_close(model.frozen_table, live, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.frozen_table[[0, 8191, 8192, 12345, 19_999]], one_by_one,
                               atol=1e-5, rtol=1e-5)
    # and the model really uses it: a changed table changes the logits
    idx = torch.tensor([[3, 8200, 19_000]])
    before = model(idx)[0]
    model.frozen_table = model.frozen_table.flip(0)
    assert not torch.allclose(model(idx)[0], before)


# sample.py: decoding


