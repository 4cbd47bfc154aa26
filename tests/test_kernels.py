"""leviathan.py's fast paths at the level of their kernels: a micro-step that never waits for the device,
Fused's compiled kernels against their eager functions (inductor's C++ here, and the Triton code a GPU runs,
in Triton's interpreter), and what Fused does when compiling fails or a compiled kernel raises. The model's
own tests are in ../test_leviathan.py."""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import leviathan
from conftest import HERE, SCRIPT_ENV, micro_model


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that make the host wait for the device: each leaves a GPU idle while
    Python has nothing to launch."""
    WAITS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.tolist, torch.unique, torch.Tensor.unique, torch.nonzero, torch.Tensor.nonzero}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WAITS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_micro_step_given_its_distinct_ids_never_waits_for_the_device():
    """A lev micro-step (forward and backward, loss included) handed the batch's distinct_ids, as
    training makes them on the CPU, never waits for the device; left to find them, it waits once,
    in torch.unique, which must know their number. The same loss and gradients either way. The
    product needs no check of its own."""
    model = micro_model("lev")
    x, y = torch.randint(0, 300, (2, 2, 16)).unbind(0)
    grads = []
    for distinct, waits in [(leviathan.distinct_ids(x), []), (None, ["unique"])]:
        with HostSyncs() as syncs:
            loss = model(x, y, distinct=distinct)
            grads.append([loss, *torch.autograd.grad(loss, list(model.parameters()))])
        assert syncs.calls == waits, syncs.calls
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def kernel_calls(heads, n, rank, group):
    """LEV's kernels with their arguments: bspline_nonzero, group_products for groups of `group`
    and of 1, product_gradients. Random parameters with negative factors, t at both end knots,
    and S a strided view, as S[:, d] is."""
    generator = torch.Generator().manual_seed(0)
    t = torch.rand(group, heads, n, generator=generator)
    t[0, 0, :2] = torch.tensor([0.0, 1.0])
    spline = 1 + 0.5 * torch.randn(heads, group + 8, 10, rank, generator=generator)[:, 4:group + 4]
    grad_times_modes = torch.randn(heads, n, rank, generator=generator)
    index, values, slopes = leviathan.bspline_nonzero(t, 10)
    return [(leviathan.bspline_nonzero, (t, 10)), (leviathan.group_products, (index, values, spline, group)),
            (leviathan.group_products, (index, values, spline, 1)),
            (leviathan.product_gradients, (index, values, slopes, spline, grad_times_modes))]


def as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def test_fused_kernels_match_their_eager_functions():
    """The compiled kernels (inductor here, Triton on a GPU) against the same functions run eagerly."""
    fused_kernel = dict(zip(leviathan.KERNELS, leviathan.FUSED_KERNELS))
    for fn, args in kernel_calls(heads=3, n=50, rank=8, group=16):
        eager = as_tuple(fn(*args))
        if fn is leviathan.group_products:
            assert (eager[0] < 0).any()
        atol = 1e-5 if fn is leviathan.product_gradients else 1e-6
        for fused, expected in zip(as_tuple(fused_kernel[fn](*args)), eager, strict=True):
            torch.testing.assert_close(fused, expected, rtol=1e-5, atol=atol)
    assert all(kernel.compiled is not None for kernel in leviathan.FUSED_KERNELS)  # none fell back to eager


def stand_in_for_a_gpu():
    """What inductor's Triton code and Triton's interpreter need to run on a CPU (TRITON_INTERPRET=1
    set before the process started): inductor's CPU backend switched from C++ to Triton (a
    config.patch, by the caller) and two stand-ins:"""
    import torch.utils._triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import TensorHandle

    # 1. inductor keys its cache by the GPU's backend, which needs a driver; there is none
    torch.utils._triton.triton_hash_with_backend = lambda: "TRITON-INTERPRETER"
    # 2. round(), frexp() and the loss's exp become libdevice calls, GPU library calls the interpreter lacks;
    #    numpy does the same (rint rounds half to even, as nearbyint does)
    def numpy_call(op, dtype=None):
        def call(x, *rest, _semantic=None):
            kind = x.type if dtype is None else x.type.with_element_ty(dtype)
            return tl.tensor(TensorHandle(op(x.handle.data, *(y.handle.data for y in rest)), kind.scalar), kind)
        return call

    libdevice.nearbyint, libdevice.exp = numpy_call(np.rint), numpy_call(np.exp)
    libdevice.isinf, libdevice.isnan = numpy_call(np.isinf, tl.int1), numpy_call(np.isnan, tl.int1)
    libdevice.ilogb = numpy_call(lambda x: (np.frexp(x)[1] - 1).astype(np.int32), tl.int32)
    libdevice.ldexp = numpy_call(lambda x, n: np.ldexp(x, n).astype(x.dtype))


def fused_kernel_errors_under_triton_interpreter():
    """Runs in a fresh process (see below): Fused's kernels built by inductor's Triton code
    generator, the one a GPU uses (with CPU block sizes), and run by Triton's interpreter on
    CPU tensors (stand_in_for_a_gpu). Returns, for each call, max |Triton - eager| / max |eager|
    for each output and how many Triton kernels it launched, and whether every call generated
    Triton source."""
    import torch._inductor.config
    import torch._inductor.utils
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    stand_in_for_a_gpu()
    calls = kernel_calls(heads=2, n=6, rank=4, group=8)
    errors, sources, launches, launch = [], [], [], CachingAutotuner.run

    def counted_launch(*args, **kwargs):  # every Triton kernel launch goes through it
        launches[-1] += 1
        return launch(*args, **kwargs)

    CachingAutotuner.run = counted_launch
    # The loss's fused step against its plain form, on logits wide enough that each row is reduced
    # in a loop, as at V = 200k; both overwrite their logits with G, so each gets its own copy.
    logits, targets, n = 3 * torch.randn(8, 8192), torch.randint(0, 8192, (8,)), 16
    plain, fused_logits = logits.clone(), logits.clone()
    calls.append((leviathan.fused_softmax_gradient_, (fused_logits, targets, n)))
    expected = {leviathan.fused_softmax_gradient_: (leviathan.softmax_gradient_(plain, targets, n), plain)}
    with torch._inductor.config.patch(cpu_backend="triton"):
        for fn, args in calls:
            kernel = leviathan.Fused(fn, fn.__name__)
            launches.append(0)
            fused, code = torch._inductor.utils.run_and_get_code(kernel, *args)
            assert kernel.compiled is not None, "compiling failed; Fused fell back to eager"
            if fn in expected:  # the loss's step: its loss, and G written over the logits
                fused = (fused, args[0])
            pairs = zip(as_tuple(fused), expected.get(fn) or as_tuple(fn(*args)), strict=True)
            errors.append([(a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in pairs])
            sources += code
    loss_buffers = re.findall(r"empty_strided\w*\(\(([^)]*)\)", sources[-1])  # what the loss's kernel allocates
    return (errors, launches, loss_buffers,
            all("@triton.jit" in source for source in sources) and len(sources) == len(calls))


def test_fused_kernels_match_eager_as_triton_kernels(monkeypatch):
    """The GPU build of LEV's kernels: no GPU runs it here, but Triton's interpreter runs its
    generated Triton code, in a fresh process so that nothing of it reaches the other tests.
    Needs Triton 3.9 or later: the tested series, which CI installs (torch's CUDA builds bring
    a Triton, maybe older). Older interpreters differ: 3.6's cannot run inductor's reduction loop
    (tl.range with a bound known only at run time: int() of a 1-element array, an error since
    NumPy 2.4; triton-lang/triton#9171). On 3.9 and later every error is the test's failure:
    Fused no longer takes one raised as the kernel runs for a failure of compiling."""
    triton = pytest.importorskip("triton", reason='needs triton: pip install "triton>=3.9,<3.10"')
    if tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) < (3, 9):
        pytest.skip(f'triton {triton.__version__} is older than the tested 3.9, whose interpreter runs '
                    f'inductor\'s kernels: pip install "triton>=3.9,<3.10"')
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # for the new process, from its start
    with torch.multiprocessing.get_context("spawn").Pool(1) as pool:
        errors, launches, loss_buffers, triton_generated = pool.apply(fused_kernel_errors_under_triton_interpreter)
    assert triton_generated
    assert len(errors) == 5 and max(max(call) for call in errors) < 1e-5, errors
    # Launches per call, for any size (one graph, dynamic=True): group_products is one kernel, so
    # phi never leaves registers; bspline_nonzero and product_gradients at most two (torch 2.13
    # makes two of each). One LEV forward + backward on a GPU launches bspline_nonzero twice,
    # group_products once per forward chunk and product_gradients once per backward chunk.
    # The loss's step per chunk: at most three kernels (torch 2.13: logsumexp, a loop over V for the
    # max and one for the sum; the loss, from [chunk] values; G, one read and one write), and it
    # allocates nothing of [chunk, V], only [chunk, 1] row statistics and the loss: nothing else
    # passes over the logits.
    assert all(1 <= n <= most for n, most in zip(launches, [2, 1, 1, 2, 3], strict=True)), launches
    assert all(shape.count(",") == 0 or shape.replace(" ", "").endswith(",1") for shape in loss_buffers), loss_buffers


def test_fused_kernels_fall_back_to_eager_when_compiling_fails(tmp_path):
    """Compiling really fails: a fresh process whose C++ compiler (inductor reads $CXX) does not
    exist, with an empty inductor cache, so that nothing compiled before is reused. Two kernels
    run eagerly, with one warning line for both, naming the cause, and are not compiled again."""
    code = """if True:
        import torch, leviathan
        t, spline = torch.rand(8, 2, 5), torch.rand(2, 8, 6, 3)
        index, values, _ = leviathan.bspline_nonzero(t, 6)
        for fn, args in [(leviathan.bspline_nonzero, (t, 6)), (leviathan.group_products, (index, values, spline, 4))]:
            kernel = leviathan.Fused(fn, "LEV")
            for _ in range(2):
                fused, eager = kernel(*args), fn(*args)
                fused, eager = [x if isinstance(x, tuple) else (x,) for x in (fused, eager)]
                assert all(torch.equal(a, b) for a, b in zip(fused, eager, strict=True))
                assert kernel.compiled is None
    """
    env = {**SCRIPT_ENV, "CXX": "/nonexistent/g++", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("warning: LEV runs eagerly (slower); torch.compile failed: InvalidCxxCompiler: ")
    assert r.stdout.count("\n") == 1 and "/nonexistent/g++" in r.stdout, r.stdout


def test_fused_kernels_fall_back_to_eager_when_the_recompile_limit_is_hit(monkeypatch, capsys):
    """Under fullgraph=True, torch raises once a kernel has recompiled recompile_limit times: that
    is a failure of compiling (the kernel runs eagerly, one warning line), not the kernel's error."""
    def double(x):
        return x * 2
    monkeypatch.setattr(leviathan.Fused, "warned", set())
    kernel = leviathan.Fused(double, "LEV")
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{limit: 1}):
        for dtype in (torch.float32, torch.float64, torch.int64):  # a new dtype: a recompile
            assert torch.equal(kernel(torch.ones(3, dtype=dtype)), torch.full((3,), 2, dtype=dtype))
    assert kernel.compiled is None
    assert "warning: LEV runs eagerly" in capsys.readouterr().out


def test_fused_kernels_raise_what_the_compiled_kernel_raises(monkeypatch, capsys):
    """An error of the compiled kernel as it runs is no failure of compiling: it propagates as
    raised, and the kernel stays compiled. Inductor's C++ checks every indirect index as it runs;
    a knot index out of range is one (eagerly, the same call raises IndexError instead)."""
    monkeypatch.setattr(leviathan.Fused, "warned", set())
    kernel = leviathan.Fused(leviathan.group_products, "LEV")
    index, values, _ = leviathan.bspline_nonzero(torch.rand(8, 2, 5), 6)
    spline = torch.rand(2, 8, 6, 3)
    out_of_range = index.clone()
    out_of_range[1, 3, 1, 2] = 6  # knots 0..5
    with pytest.raises(RuntimeError, match="index out of bounds"):
        kernel(out_of_range, values, spline, 4)
    assert kernel.compiled is not None and capsys.readouterr().out == ""
    args = index, values, spline, 4
    for a, b in zip(as_tuple(kernel(*args)), as_tuple(leviathan.group_products(*args)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
