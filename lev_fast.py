"""LEV's fast path: steps 3c-3e of leviathan.LEV.generate_reference (the B-spline basis, phi_d and
the product M_l = prod_d phi_d) with the same arithmetic, without its cost; and what
torch.compile sees. leviathan.py holds the method as its equations and calls separable_modes
from LEV.generate; the tests hold the two paths together in value and gradient.

Written out, steps 3c-3e hold a dense basis [h, N, d_seed, kappa] and phi [h, N, d_seed, r] for
the backward: at the paper's sizes ~1 GB for a few hundred ids. Here:
- Only the 3 non-zero B_m(t_d) are made (bspline_nonzero), once per call, as small planes.
- phi_d = the 3 rows of S around t_d's nearest knot mixed by those values: float32 multiply-adds,
  no matmul, so exact float32 on any device (group_products).
- phi is never written to memory: compiled into one fused kernel (C++ on a CPU, Triton on a GPU),
  each phi_d is made in registers and multiplied into its group's product at once; the backward
  (product_gradients) makes phi again from t. Only t, S and M are saved.
- (R) The product of d_seed factors cannot under- or overflow: each phi_d and the running product
  are carried as mantissa x 2^exponent (group_products, modes_from_groups). The same product as
  sign * exp(sum log|phi_d|), without a logarithm per factor, and no check.
- The coordinates are worked through in chunks (seed_chunks), so memory stays bounded.
"""
import torch

# -----------------------------------------------------------------------------
# Steps 3c-3e, fused and exact


def bspline_nonzero(t, knots):
    """Step 3c, the non-zero part. beta has support |x| < 1.5, so of B_m(t) = beta((t - g_m)(kappa - 1))
    only the knot c nearest to t and its two neighbours are non-zero: with f = t (kappa - 1) - c
    in [-0.5, 0.5], beta(f + 1) = (0.5 - f)^2 / 2, beta(f) = 0.75 - f^2, beta(f - 1) = (0.5 + f)^2 / 2.
    Returns three [3, ...] tensors, one plane j for each of the knots c - 1, c, c + 1: the index m
    (int32, clamped into [0, kappa)), B_m(t) and the slope dB_m/dt (for the backward pass)."""
    position = t * (knots - 1)
    nearest = position.round()
    f = position - nearest
    # beta = a + b f + c f^2, one row per neighbour; the neighbours lead, so each plane is contiguous
    a, b, c = torch.tensor([[0.125, -0.5, 0.5], [0.75, 0.0, -1.0], [0.125, 0.5, 0.5]], dtype=t.dtype,
                           device=t.device).view(3, 3, *[1] * t.dim()).unbind(1)
    neighbours = nearest + torch.arange(-1, 2, device=t.device).view(3, *[1] * t.dim())
    inside = (neighbours >= 0) & (neighbours < knots)
    values, slopes = (a + b * f + c * f**2) * inside, (b + 2 * c * f) * inside * (knots - 1)
    # (R) Normalised as in leviathan.bspline_basis: at the two end knots a neighbour falls outside [0, kappa).
    total = values.sum(0)
    values = values / total
    slopes = (slopes - values * slopes.sum(0)) / total  # quotient rule; slopes.sum(0) = 0 inside
    return neighbours.clamp_(0, knots - 1).int(), values, slopes


def knot_rows(spline, index):
    """S_l[d, m] at the 3 knots m = index[j] of each (d, l, n): three [d, h, N, r] tensors.
    Compiled, they are indirect loads inside the kernel and never written to memory."""
    heads, seed_dim = spline.shape[:2]
    d = torch.arange(seed_dim, device=index.device).view(-1, 1, 1)
    head = torch.arange(heads, device=index.device).view(1, -1, 1)
    return [spline[head, d, index[j]] for j in range(3)]


def mix_rows(rows, weights):
    """sum_j weights[j] * rows[j]: phi_d with the B-spline values as weights, dphi_d/dt_d with
    their slopes; three float32 multiply-adds per element."""
    return sum(row * weights[j, ..., None] for j, row in enumerate(rows))


# The two kernels below take the B-spline planes of bspline_nonzero, made once per call for all
# of t (a small [3, d, h, N]), rather than t: made inside, the knot index would be worked out
# again for every r-vector of phi, which costs LEV's forward + backward 4-10% more on a CPU.


def group_products(index, values, spline, group):
    """Steps 3d and part of 3e for a chunk of coordinates, S [h, d, kappa, r]: phi_d =
    sum_m B_m(t_d) S_l[d, m] as 3 float32 multiply-adds (only 3 B_m are non-zero; no dense basis,
    no matmul, so exact float32 on any device), multiplied over groups of `group` consecutive
    coordinates as mantissa and exponent: phi_d = m_d 2^(e_d) with |m_d| in [0.5, 1) (frexp), and
    the group's product is (prod_d m_d) 2^(sum_d e_d), two [d / group, h, N, r] tensors. A product
    of g <= 126 such mantissas never leaves float32's normal range, whatever phi is, so each of
    its partial products rounds exactly as a plain float32 product of the phi_d would, had that
    one stayed in range. Compiled (Fused, below), phi lives in registers only. The price is paid
    on a CPU, where inductor's C++ calls frexp one element at a time: LEV's forward + backward
    takes 1.3-1.8x as long (interleaved runs) as with a plain product whose exactness is checked
    afterwards; but that check would make a GPU wait for its result at every call, where frexp
    is a few instructions per element (ilogb, ldexp)."""
    mantissas, exponents = torch.frexp(mix_rows(knot_rows(spline, index), values))
    return mantissas.unflatten(0, (-1, group)).prod(1), exponents.unflatten(0, (-1, group)).sum(1)


def product_gradients(index, values, slopes, spline, grad_times_modes):
    """The backward of M_l = prod_d phi_d for a chunk of coordinates, with G M = dL/dM * M:
    q_d = dL/dphi_d = G M / phi_d (dM/dphi_d = M / phi_d), dL/dt_d = <q_d, dphi_d/dt_d>
    (dphi_d/dt_d = sum_m dB_m/dt_d S_l[d, m], reduced over r as it is made), and the dense
    basis B_m(t_d), [d, h, N, kappa], for dL/dS_l[d, m] = sum_n B_m(t_d) q_d (a matmul)."""
    rows = knot_rows(spline, index)
    phi, phi_slope = mix_rows(rows, values), mix_rows(rows, slopes)
    q = grad_times_modes / phi
    knots = torch.arange(spline.shape[2], device=index.device)
    basis = sum(values[j, ..., None] * (index[j, ..., None] == knots) for j in range(3))
    return q, (q * phi_slope).sum(-1), basis


# LEV works on a chunk of seed coordinates at a time, at most this many floats of phi (or one
# group of coordinates if that is more), so its memory stays bounded. On a CPU, 4 MB: the
# backward's q_d (below) is still in cache when the matmul reads it. On a GPU, 256 MB: there
# each chunk costs kernel launches, and at 1.2b one coordinate's q_d is ~3 MB.
CHUNK_FLOATS_CPU, CHUNK_FLOATS_GPU = 1 << 20, 1 << 26


def seed_chunks(t, rank, multiple=1):
    """Slices of the seed coordinates d, each a multiple of `multiple` long."""
    seed_dim, heads, n = t.shape
    budget = CHUNK_FLOATS_CPU if t.device.type == "cpu" else CHUNK_FLOATS_GPU
    size = max(1, budget // (heads * n * rank)) // multiple * multiple or multiple
    return [slice(d, min(d + size, seed_dim)) for d in range(0, seed_dim, size)]


def product_group(seed_dim):
    """How many factors group_products multiplies in one go: the largest divisor of d_seed <= 64
    (a product of 64 mantissas is >= 2^-64, well inside float32's normal range, >= 2^-126)."""
    return max(g for g in range(1, 65) if seed_dim % g == 0)


def modes_from_groups(t, spline):
    """M = prod_d phi_d as mantissa * 2^exponent with |mantissa| in [0.5, 1): each group's
    product comes as mantissa and exponent (group_products), and after multiplying it in,
    frexp moves the running product's scale into the integer exponent. No partial product
    leaves float32's normal range however many factors M has, so the product is exact in the
    sense of generate_reference's sign * exp(sum_d log|phi_d|), without a logarithm per factor,
    and nothing needs checking: no wait for a GPU."""
    seed_dim, heads, n = t.shape
    group = product_group(seed_dim)
    mantissa = t.new_ones(heads, n, spline.shape[-1])
    exponent = torch.zeros(mantissa.shape, dtype=torch.int32, device=t.device)
    bspline, products_of_groups, _ = kernels_for(t, spline)
    index, values, _ = bspline(t, spline.shape[2])
    for d in seed_chunks(t, spline.shape[-1], group):
        mantissas, exponents = products_of_groups(index[:, d], values[:, d], spline[:, d], group)
        for group_mantissa, group_exponent in zip(mantissas.unbind(0), exponents.unbind(0)):
            mantissa, scale = torch.frexp(mantissa * group_mantissa)
            exponent = exponent + scale + group_exponent
    return torch.ldexp(mantissa, exponent)


class SeparableProduct(torch.autograd.Function):
    """Steps 3c-3e: t [d_seed, h, N], S [h, d_seed, kappa, r] -> M_l = prod_d phi_d, [h, N, r].

    phi, [d_seed, h, N, r], is LEV's one big tensor, and it is never written: the fused forward
    multiplies each phi_d into a group product as it is made, and the backward makes it again
    from t. Only t, S and M are saved.

    (R) A plain product of 128 factors can under- or overflow float32, so M is carried as
    mantissa * 2^exponent (modes_from_groups): the exact product, as generate_reference's
    sign * exp(sum_d log|phi_d|) is, without a logarithm per factor.

    Backward (product_gradients, a chunk of coordinates at a time): q_d is written, as the
    matmul for dL/dS needs it (with TF32 on, that matmul rounds like the rest of the
    backward; phi and M never go through a matmul)."""

    @staticmethod
    def forward(ctx, t, spline):
        modes = modes_from_groups(t, spline)
        ctx.save_for_backward(t, spline, modes)
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        t, spline, modes = ctx.saved_tensors
        grad_t, grad_spline = torch.empty_like(t), torch.empty_like(spline)
        grad_times_modes = (grad_modes * modes).contiguous()  # dL/dM * M, the same for every d
        bspline, _, gradients = kernels_for(t, spline)
        index, values, slopes = bspline(t, spline.shape[2])
        for d in seed_chunks(t, spline.shape[-1]):
            q, grad_t[d], basis = gradients(index[:, d], values[:, d], slopes[:, d], spline[:, d], grad_times_modes)
            grad_spline[:, d] = (basis.transpose(-1, -2) @ q).transpose(0, 1)
        return grad_t, grad_spline


@torch.compiler.disable
def separable_modes(t, spline):
    """SeparableProduct, kept out of every compiled graph (see "What torch.compile sees")."""
    return SeparableProduct.apply(t, spline)


# -----------------------------------------------------------------------------
# What torch.compile sees: every decision, in one place
#
# 1. The product's three kernels (bspline_nonzero, group_products, product_gradients) are
#    compiled on their own, whether or not the model is (Fused, below): phi stays in registers
#    only if they are. A call with fewer than FUSE_MIN_FLOATS floats of phi (a test-sized LEV)
#    runs them eagerly: compiling costs seconds, once per process, which such a call never repays.
# 2. separable_modes, which calls them, stays out of every other graph (torch.compiler.disable):
#    traced, its backward's rebuilt phi would be merged with the forward's, and phi saved after all.
# 3. LEV.forward (leviathan.py) stays out too (torch.compiler.disable): torch.unique's output
#    size changes with every batch, and the backbone after it should see one shape.
# 4. Model.compile (leviathan.py): the model in place (backbone, head, loss), and LEV.generate on
#    its own for any number of ids (compile_lev, dynamic=True), which fuses the small steps around
#    the product.

FUSE_MIN_FLOATS = 1 << 20


# What a failure of compiling itself arrives as (torch 2.4-2.13: torch/_dynamo/exc.py,
# torch/_inductor/exc.py), raised before the compiled kernel runs: BackendCompilerFailed, dynamo's
# wrapper around whatever inductor raised (no C++ compiler: InvalidCxxCompiler; a failing one:
# CppCompileError; a Triton compile error), in newer torch as its subclass InductorError;
# ShortenTraceback, their base in newer torch, which also carries TritonMissing and
# GPUTooOldForTriton (an unsupported GPU) unwrapped; Unsupported and InternalTorchDynamoError,
# dynamo refusing or failing to trace fn. By name, as an older torch lacks some (torch._dynamo is
# loaded: torch.compiler.disable above). Not caught: what the kernel raises as it runs (out of
# memory, an index out of bounds, a device-side assert, a Triton launch error), a fault to see,
# not a reason to run LEV ~6x slower from then on.
COMPILE_FAILURES = tuple(getattr(torch._dynamo.exc, name) for name in
                         ("BackendCompilerFailed", "ShortenTraceback", "Unsupported", "InternalTorchDynamoError")
                         if hasattr(torch._dynamo.exc, name))


class Fused:
    """fn compiled by torch.compile into fused kernels (inductor: C++ loops on a CPU, Triton on
    a GPU; group_products is one, so phi stays in registers). Where compiling fails (no C++
    compiler, an unsupported GPU), fn runs eagerly: the same result, slower, with one warning
    line for all the kernels. An error of the compiled kernel as it runs propagates, and the
    kernel stays compiled."""
    warned = False

    def __init__(self, fn):
        self.fn, self.compiled = fn, torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except COMPILE_FAILURES as error:
                if not Fused.warned:
                    cause = getattr(error, "inner_exception", error)  # what inductor raised, in any torch
                    reason = f"{type(cause).__name__}: {cause}".split("\n")[0]
                    print(f"warning: LEV runs eagerly (slower); torch.compile failed: {reason}")
                    Fused.warned = True
                self.compiled = None
        return self.fn(*args)


KERNELS = bspline_nonzero, group_products, product_gradients
FUSED_KERNELS = tuple(Fused(kernel) for kernel in KERNELS)


def kernels_for(t, spline):
    """(bspline_nonzero, group_products, product_gradients) for this call: fused where it pays
    for compiling."""
    return FUSED_KERNELS if t.numel() * spline.shape[-1] >= FUSE_MIN_FLOATS else KERNELS


def compile_lev(lev, **options):
    """LEV.generate compiled for any number of ids; its product stays eager (2.), its kernels fused (1.)."""
    lev.generate = torch.compile(lev.generate, dynamic=True, **options)
