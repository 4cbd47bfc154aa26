"""The test suite: python -m pytest -q test_leviathan.py (CPU only, no network)."""
import math

import pytest
import torch

from leviathan import (EMBEDDINGS, LEV, SIZES, Config, Model, SplineProduct, bspline_basis,
                       lev_base, to_digits)

# A model small enough to train in seconds, with every arm's machinery in place.
MICRO = Config(vocab_size=300, d_model=64, n_layer=2, n_head=4, seq_len=32,
               lev_seed_dim=16, lev_heads=2, lev_knots=8, lev_rank=8)


def micro_model(embedding, seed=0, **overrides):
    torch.manual_seed(seed)
    return Model(Config(**{**MICRO.__dict__, "embedding": embedding, **overrides}))


def lev_param_formula(V, D, k=3, d_seed=128, h=8, kappa=16, r=64):
    b = lev_base(V, k)
    return k * b * d_seed + h * d_seed**2 + 2 * h * d_seed + h * d_seed * kappa * r + h * r * D


# ---------------------------------------------------------------------------- LEV


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


def test_bspline_basis_is_a_partition_of_unity():
    t = torch.cat([torch.linspace(1e-6, 1 - 1e-6, 10_001), torch.tensor([0.5, 1 / 15, 14 / 15])])
    basis = bspline_basis(t.double(), 16)
    assert basis.shape == (t.numel(), 16)
    assert (basis >= 0).all()
    assert ((basis > 1e-12).sum(-1) <= 3).all()  # a 4th can be ~1e-16 when t sits on a half-knot
    assert torch.allclose(basis.sum(-1), torch.ones_like(t, dtype=torch.double), atol=1e-12)
    # away from the ends the raw quadratic B-spline already sums to one: unchanged there
    g = 7 / 15
    raw = {-1: 0.125, 0: 0.75, 1: 0.125}  # beta(1), beta(0), beta(-1) at a knot
    at_knot = bspline_basis(torch.tensor([g], dtype=torch.double), 16)[0]
    for offset, value in raw.items():
        assert at_knot[7 + offset].item() == pytest.approx(value)


def spec_reference(lev, ids):
    """LEV written the slow, obvious way: one id and one head at a time (spec steps 1-4)."""
    out = []
    for i in ids.tolist():
        digits = [(i // lev.base ** (lev.digits - 1 - j)) % lev.base for j in range(lev.digits)]
        z = sum(lev.codebooks[j, digits[j]] for j in range(lev.digits))
        E = 0
        for l in range(lev.seed_proj.shape[0]):
            u = torch.nn.functional.layer_norm(z @ lev.seed_proj[l], z.shape, lev.norm_weight[l],
                                               lev.norm_bias[l], 1e-5)
            phi = torch.einsum("dk,dkr->dr", bspline_basis(torch.sigmoid(u), lev.knots), lev.spline[l])
            E = E + phi.prod(0) @ lev.out_proj[l]
        out.append(E)
    return torch.stack(out)


def test_lev_matches_the_spec_written_out():
    torch.manual_seed(0)
    lev = LEV(1000, 32, seed_dim=24, heads=3, knots=10, rank=6).double()
    with torch.no_grad():
        lev.spline.normal_(1.0, 0.5)  # make some factors negative: the sign parity matters
    ids = torch.tensor([0, 1, 9, 10, 99, 100, 500, 999])
    assert torch.allclose(lev.generate(ids), spec_reference(lev, ids), atol=1e-12)


def test_spline_product_gradient():
    torch.manual_seed(0)
    basis = torch.rand(2, 5, 3, 4, dtype=torch.double, requires_grad=True)
    spline = torch.randn(2, 5, 4, 3, dtype=torch.double, requires_grad=True)  # mixed signs
    assert torch.autograd.gradcheck(SplineProduct.apply, (basis, spline))


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
    model(idx, idx)[1].backward()
    for name, p in model.lev.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_frozen_table_equals_lev():
    model = micro_model("lev")
    ids = torch.arange(MICRO.vocab_size)
    with torch.no_grad():
        expected = model.lev(ids)
    table = model.lev.as_table(chunk=64)  # several chunks, the last one partial
    assert torch.allclose(table, expected, atol=1e-6)


# ---------------------------------------------------------------------------- the model


def test_size_presets_match_the_paper():
    nominal = {"200m": 200e6, "400m": 400e6, "1.2b": 1.2e9}
    with torch.device("meta"):
        for name, target in nominal.items():
            tied = Model(Config.from_size(name, embedding="tied")).param_counts()["total"]
            assert abs(tied / target - 1) < 0.05, (name, tied)
        lev = Model(Config.from_size("1.2b")).param_counts()
        tied = Model(Config.from_size("1.2b", embedding="tied")).param_counts()
    assert SIZES["1.2b"].d_model == 2048
    assert lev["input"] == lev_param_formula(SIZES["1.2b"].vocab_size, 2048)
    assert lev["total"] <= 1.0025 * tied["total"]  # the paper: ~0.2% larger
    for cfg in SIZES.values():
        assert cfg.ffn_dim % 128 == 0 and cfg.ffn_dim >= 8 * cfg.d_model / 3
    with pytest.raises(ValueError, match="unknown size"):
        Config.from_size("7b")


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
    logits, _ = model(idx, idx)
    logits_changed, _ = model(changed, changed)
    assert torch.allclose(logits[0, :t + 1], logits_changed[0, :t + 1], atol=1e-6)
    assert not torch.allclose(logits[0, t + 1], logits_changed[0, t + 1])


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_kv_cache_gives_the_same_logits(embedding):
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.02)
    idx = torch.randint(0, MICRO.vocab_size, (2, 12))
    full, _ = model(idx, idx)
    cache = model.new_cache(batch=2)
    stepwise = [model(idx[:, :5], cache=cache)[0]]  # prefill 5 tokens, then one at a time
    stepwise += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
    assert torch.allclose(torch.cat(stepwise, 1), full[:, 4:], atol=1e-5)


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_micro_model_overfits_a_fixed_batch(embedding):
    model = micro_model(embedding)
    # 3e-3, not 1e-2: LEV's product of d_seed factors turns large Adam steps into
    # loss spikes (at 1e-2 it reaches ~1.3, then jumps back to ~2.3).
    opt = model.configure_optimizers(lr=3e-3, weight_decay=0.0)
    torch.manual_seed(1)
    batch = torch.randint(0, MICRO.vocab_size, (4, MICRO.seq_len + 1))
    for step in range(120):
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 1.0, f"{embedding}: loss {loss.item():.3f} after {step + 1} steps"


def test_weight_decay_spares_lev_and_tables():
    for embedding in EMBEDDINGS:
        model = micro_model(embedding)
        decay, no_decay = model.configure_optimizers(lr=1e-3, weight_decay=0.1).param_groups
        decayed = {id(p) for p in decay["params"]}
        assert id(model.head.weight) in decayed
        assert id(model.blocks[0].mlp.down.weight) in decayed
        assert id(model.norm.weight) not in decayed
        if embedding == "lev":
            assert not decayed & {id(p) for p in model.lev.parameters()}
        if embedding == "untied":
            assert id(model.embed.weight) not in decayed


def test_compiled_model_does_not_recompile_when_distinct_ids_change():
    """LEV's torch.unique stays outside the compiled graph and its generator is compiled
    with a dynamic N, so batches with different numbers of distinct ids reuse the graphs."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = micro_model("lev")
    model.lev.compile_generator(backend=counting_backend)
    compiled = torch.compile(model, backend=counting_backend)
    counts = []
    for n_distinct in (5, 17, 40, 64):
        idx = torch.arange(2 * MICRO.seq_len).view(2, -1) % n_distinct  # n_distinct ids
        _, loss = compiled(idx, idx)
        loss.backward()
        counts.append(len(graphs))
    assert counts[0] > 0
    assert counts[1:] == counts[:1] * 3, f"graphs compiled after each batch: {counts}"


def test_readme_test_command_is_what_ci_runs():
    from pathlib import Path
    here = Path(__file__).parent
    ci_command = (here / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command == "python -m pytest -q test_leviathan.py"
    assert f"```bash\n{ci_command}\n```" in (here / "README.md").read_text()
