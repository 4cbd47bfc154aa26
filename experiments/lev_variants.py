"""LEV with one reconstructed detail of step 3c changed, for the CPU-scale study (study.py, plan
`lev-variants`): train.py's main with leviathan's LEV replaced by the variant.

    python -m experiments.lev_variants --lev_variant=raw-basis <train.py options>

- raw-basis: the B-spline basis not renormalised to a partition of unity; its sum dips to 0.875
  at the end knots (the first author's KHRONOS code does not renormalise).
- knot-scale: the distance to the knots multiplied by a learnable scale per head and seed
  coordinate, x = (t - g_m) s, s initialised to kappa - 1 (the fixed scale of leviathan.py, as
  in KHRONOS); the basis still renormalised.

Both compute steps 3c-3e through the dense equations of LEV.generate_reference with their own
basis: away from s = kappa - 1 more than three knots can be non-zero, so the fast path's
three-knot kernels do not apply. Slower than the fast path: the reference's equations, compiled
above a test's size (fused, so rounded differently). Every other step, the parameters and their
initialisation are LEV's, so at a given seed a variant starts from the same values as
leviathan.py's LEV. Resume works as for train.py: the knot scale is a parameter, in the checkpoint.

train.py itself is not changed: leviathan.LEV, from which leviathan.Model builds its input side,
is the variant's class while train.py's main runs with the other options. A variant's LEV holds
a buffer named after it (variant_raw_basis, variant_knot_scale), saved in the checkpoint: train.py,
sample.py and the export, which build leviathan.py's LEV, refuse the checkpoint as they load it
(an unexpected key), and this command refuses to resume, or evaluate, another variant's.
"""
import os
import sys
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.lev_variants")

import torch
import torch.nn as nn

import leviathan
import train
from experiments.cli import run_main
from prepare_data import UserError

# Above this many floats of phi ([h, N, d_seed, r]) a call runs compiled (inductor fuses the basis
# and the product's elementwise steps: ~4x faster on a CPU); a test-sized call runs eagerly,
# where compiling would cost more than it saves.
COMPILE_MIN_FLOATS = 1 << 20


def quadratic_bspline(x):
    """beta(x), the centred quadratic B-spline of step 3c (as in leviathan.bspline_basis)."""
    return torch.where(x.abs() < 0.5, 0.75 - x**2, torch.where(x.abs() < 1.5, 0.5 * (1.5 - x.abs()) ** 2, 0.0))


def scaled_basis(t, scale, knots, normalise):
    """Step 3c with the distance to each knot scaled: B_m(t) = beta((t - g_m) s), t [h, N, d_seed],
    s [h, d_seed] -> [h, N, d_seed, kappa]. Written t s - m (s / (kappa - 1)), so that at
    s = kappa - 1 every value is bit for bit leviathan.bspline_basis's. Renormalised, the sum
    stays positive while s < 3 (kappa - 1): the three knots nearest to t still reach it."""
    s = scale[:, None, :, None]
    x = t.unsqueeze(-1) * s - torch.arange(knots, device=t.device) * (s / (knots - 1))
    beta = quadratic_bspline(x)
    return beta / beta.sum(-1, keepdim=True) if normalise else beta


def dense_modes(t, scale, spline, normalise):
    """Steps 3c-3e as LEV.generate_reference writes them, with scaled_basis as the basis:
    t [h, N, d_seed] -> M_l = sign * exp(sum_d log|phi_d|), [h, N, r]."""
    basis = scaled_basis(t, scale, spline.shape[2], normalise)
    phi = torch.einsum("hndm,hdmr->hndr", basis, spline)
    return phi.sign().prod(2) * phi.abs().log().sum(2).exp()


compiled_dense_modes = torch.compile(dense_modes, dynamic=True, fullgraph=True)


def marker(name):
    """The buffer that names a variant in its LEV's state_dict."""
    return "variant_" + name.replace("-", "_")


class DenseLEV(leviathan.LEV):
    """LEV whose steps 3c-3e are dense_modes: the basis with a knot scale (knot_scale()) and with
    or without renormalisation (normalise); its variant's marker among its buffers."""
    normalise = True
    name = None  # the variant's, in VARIANTS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer(marker(self.name), torch.zeros(()))  # no random draw: LEV's init kept

    def knot_scale(self):
        """s [h, d_seed]: leviathan.py's fixed kappa - 1."""
        return self.norm_weight.new_full(self.norm_weight.shape, self.knots - 1.0)

    def generate(self, ids):
        """E_i for a 1-D tensor of ids, [N] -> [N, D]; in float32, as LEV.generate."""
        with torch.autocast(ids.device.type, enabled=False):
            t = self.coordinates(ids)  # 1-3b: [h, N, d_seed]
            big = t.numel() * self.spline.shape[-1] >= COMPILE_MIN_FLOATS
            modes = (compiled_dense_modes if big else dense_modes)(t, self.knot_scale(), self.spline, self.normalise)
            return torch.einsum("hnr,hrD->nD", modes, self.out_proj)  # 3f, 4


class RawBasisLEV(DenseLEV):
    """The basis not renormalised: sum_m B_m(t) dips to 0.875 at t = 0 and t = 1."""
    name = "raw-basis"
    normalise = False


class KnotScaleLEV(DenseLEV):
    """x = (t - g_m) s with s a parameter [h, d_seed], initialised to kappa - 1."""
    name = "knot-scale"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Made after LEV's own parameters, from no random draw: the others get the values they
        # would get in leviathan.py's LEV at the same seed. In the optimizer it joins LEV's group.
        self.scale = nn.Parameter(self.norm_weight.new_full(self.norm_weight.shape, self.knots - 1.0))

    def knot_scale(self):
        return self.scale


VARIANTS = {cls.name: cls for cls in (RawBasisLEV, KnotScaleLEV)}
OPTION = "--lev_variant="


def saved_variant(path):
    """The variant whose LEV a checkpoint holds, by its marker; None for leviathan.py's LEV."""
    keys = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]
    return next((name for name in VARIANTS if f"lev.{marker(name)}" in keys), None)


def main(argv):
    """train.py's main(argv but --lev_variant), leviathan.LEV being the variant's class. A resume or
    --eval_only of another variant's checkpoint, or of leviathan.py's LEV, is refused."""
    given = [a for a in argv if a.startswith(OPTION)]
    names = [a.removeprefix(OPTION) for a in given]
    if len(names) != 1 or names[0] not in VARIANTS:
        raise UserError(f"expected one {OPTION}NAME with NAME among {', '.join(VARIANTS)}; "
                        f"got {' '.join(given) or 'none'}")
    argv = [a for a in argv if not a.startswith(OPTION)]
    options = train.read_options(argv)
    if options.resume or options.eval_only:  # else another LEV's weights would load as this one's
        path = os.path.join(options.out_dir, "ckpt.pt")
        there = saved_variant(path)
        if there is None:
            raise UserError(f"{path} holds leviathan.py's LEV, not the {names[0]} variant's: "
                            "read it with train.py")
        if there != names[0]:
            raise UserError(f"{path} holds the {there} variant's LEV, not the {names[0]} "
                            f"variant's: read it with {OPTION}{there}")
    leviathan.LEV = VARIANTS[names[0]]  # what leviathan.Model builds its input side from
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
