"""The fused draft loss against the plain reference (float64), chunking, autograd and memory."""

import math
import os
import subprocess
import sys
import warnings

import pytest
import tolerances
import torch
from kernel_builds import COMPILED, NATIVE_BUILDS
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_trainer.loss import (
    BlockCredit,
    LossTerms,
    PairTerm,
    chunk_rows,
    fused,
    fused_draft_loss,
    native,
    reference_draft_loss,
    slot_weights,
)

F64 = torch.float64


def make_inputs(n=41, h=16, v=60, dtype=F64, seed=0, correct_share=0.5):
    """Random rows where about ``correct_share`` of labels equal the student argmax (so CAP has rows)."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g, dtype=F64)
    ht = hs + 0.7 * torch.randn(n, h, generator=g, dtype=F64)  # a teacher that mostly agrees
    w_head = torch.randn(v, h, generator=g, dtype=F64) * 0.6
    labels = torch.randint(0, v, (n,), generator=g)
    take = torch.rand(n, generator=g) < correct_share
    labels[take] = (hs @ w_head.T).argmax(-1)[take]
    weights = torch.rand(n, generator=g, dtype=F64) + 0.1
    weights[::6] = 0.0  # rows without loss (slot 0, padding, loss_mask 0)
    slots = torch.arange(n) % 5
    return hs.to(dtype).requires_grad_(), ht.to(dtype), w_head.to(dtype), labels, weights.to(dtype), slots


TERMS = {
    "ce": LossTerms(),
    "kl_only": LossTerms(kl_weight=1.0, temperature=2.0),
    "cap_only": LossTerms(kl_weight=0.0, cap_weight=0.7),
    "cap_tempered": LossTerms(cap_weight=0.7, cap_temperature=0.6),
    "combined_T1": LossTerms(kl_weight=0.15, cap_weight=0.1),
    "combined_T": LossTerms(kl_weight=0.15, temperature=1.8, cap_weight=0.1),
    "teacher_labels": LossTerms(kl_weight=0.3, temperature=0.7, cap_weight=0.2, label_source="teacher"),
    "softcap_scale": LossTerms(kl_weight=0.2, temperature=1.5, cap_weight=0.3, softcap=2.5, logit_scale=0.8),
    "softcap_ce": LossTerms(softcap=4.0),
    "ce_with_unused_temperature": LossTerms(temperature=2.0),  # T only tempers the KL term
}


KERNELS = pytest.mark.parametrize("compiled", [False, "native"], ids=["eager", "native"])


@KERNELS
@pytest.mark.parametrize("name", list(TERMS))
def test_matches_reference_float64(name, compiled):
    terms = TERMS[name]
    hs, ht, w_head, labels, weights, _ = make_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, metrics = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=7, compile=compiled)
    assert not [w for w in caught if "could not be built" in str(w.message)]
    (grad,) = torch.autograd.grad(loss, hs)
    ref_loss, ref_metrics = reference_draft_loss(hs, ht, w_head, labels, weights, terms)
    (ref_grad,) = torch.autograd.grad(ref_loss, hs)
    assert loss.dtype == F64
    loss_bound, grad_bound, term_bound = tolerances.fused_loss_float64_apart(hs, ht, w_head, labels, weights, terms)
    assert abs(loss.item() - ref_loss.item()) <= loss_bound
    assert ((grad - ref_grad).abs() <= grad_bound).all()
    assert grad[weights == 0].abs().max().item() == 0.0  # weight-0 rows get no gradient
    for key in ("ce", "kl", "cap", "accuracy", "agreement"):
        assert abs(metrics[key].item() - ref_metrics[key].item()) <= term_bound, key
    assert metrics["correct"].item() > 0  # CAP really had rows to act on


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_chunk_invariance(chunk):
    hs, ht, w_head, labels, weights, _ = make_inputs(n=29)
    terms = TERMS["combined_T"]
    base, _ = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=29)
    (base_grad,) = torch.autograd.grad(base, hs)
    loss, _ = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=chunk)
    (grad,) = torch.autograd.grad(loss, hs)
    loss_bound, grad_bound, _ = tolerances.fused_loss_float64_apart(hs, ht, w_head, labels, weights, terms)
    assert abs(loss.item() - base.item()) <= loss_bound
    assert ((grad - base_grad).abs() <= grad_bound).all()


@pytest.mark.parametrize("kernel", ["native"])
@pytest.mark.parametrize("chunk", [1, 7])
def test_compiled_matches_eager_across_chunkings(chunk, kernel):
    """One kernel serves every chunk length (the last chunk, compacted rows, a chunk of one row)."""
    hs, ht, w_head, labels, weights, slots = make_inputs(n=29)
    terms, kw = TERMS["combined_T"], dict(slot_ids=slots, num_slots=5)
    base, base_m = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=29, compile=False, **kw)
    (base_grad,) = torch.autograd.grad(base, hs)
    loss, m = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=chunk, compile=kernel, **kw)
    (grad,) = torch.autograd.grad(loss, hs)
    loss_bound, grad_bound, term_bound = tolerances.fused_loss_float64_apart(hs, ht, w_head, labels, weights, terms)
    assert abs(loss.item() - base.item()) <= loss_bound
    assert ((grad - base_grad).abs() <= grad_bound).all()
    assert ((m["per_slot"]["ce"] - base_m["per_slot"]["ce"]).abs() <= term_bound).all()
    with torch.no_grad():  # inference: the kernel without its gradient pass
        loss_ng, _ = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=chunk, compile=kernel, **kw)
    assert abs(loss_ng.item() - base.item()) <= loss_bound


def test_kernel_policy(monkeypatch):
    monkeypatch.delenv(fused.COMPILE_ENV, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kind = fused.epilogue_kind
    # On the CPU the native kernel runs at every size (a build costs about a second, once per machine).
    assert kind("auto", cpu, torch.bfloat16) == "native"
    assert kind("auto", cpu, torch.float64) == kind(True, cpu, torch.float32) == "native"
    # On CUDA the Triton kernel where triton imports (bf16/fp32 heads; the device is not touched) ...
    if fused.triton_epilogue() is not None:
        assert kind("auto", cuda, torch.bfloat16) == kind(True, cuda, torch.float32) == "triton"
    assert kind("auto", cuda, torch.float64) == "eager"
    with pytest.raises(ValueError, match="compile='triton' takes a bf16 or fp32 head"):
        kind("triton", cuda, torch.float64)
    # ... and without it the eager passes: import triton failing
    monkeypatch.setattr(fused, "_triton_module", None)
    monkeypatch.setattr(fused, "TRITON_ERROR", "ImportError: No module named 'triton'")
    assert kind("auto", cuda, torch.bfloat16) == kind(True, cuda, torch.bfloat16) == "eager"
    with pytest.raises(ValueError, match="needs triton and a CUDA device.*No module named"):
        kind("triton", cuda, torch.bfloat16)
    assert kind("auto", cpu, torch.float16) == kind(True, cpu, torch.float16) == "eager"
    assert kind(False, cpu, torch.float32) == "eager"
    with pytest.raises(ValueError, match="compile='native' runs on the CPU"):
        kind("native", cuda, torch.bfloat16)
    for gone in ("yes", "inductor"):  # inductor was removed: slower than the native kernel everywhere measured
        with pytest.raises(ValueError, match="compile must be"):
            kind(gone, cpu, torch.float32)
    for env, expected in (("0", "eager"), ("1", "native"), ("native", "native")):
        monkeypatch.setenv(fused.COMPILE_ENV, env)
        assert kind("auto", cpu, torch.float32) == expected
    monkeypatch.setenv(fused.COMPILE_ENV, "native")  # the environment asks for it where it applies
    assert kind("auto", cuda, torch.float64) == "eager"


def test_a_kernel_that_cannot_be_built_falls_back(monkeypatch, tmp_path):
    """No C++ compiler: one warning naming why, then what "auto" runs without the kernel; still exact."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(fused, "_NATIVE_WARNED", False)
    native.reset()
    try:
        hs, ht, w_head, labels, weights, _ = make_inputs()
        terms = TERMS["combined_T"]
        ref, _ = reference_draft_loss(hs, ht, w_head, labels, weights, terms)
        with pytest.warns(UserWarning, match="CPU kernel could not be built.*nonexistent") as caught:
            for _ in range(2):
                loss, _ = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=7)
        assert len([w for w in caught if "could not be built" in str(w.message)]) == 1
        assert fused.epilogue_kind("auto", torch.device("cpu"), F64) == "eager"
        assert (
            abs(loss.item() - ref.item())
            <= tolerances.fused_loss_float64_apart(hs, ht, w_head, labels, weights, terms)[0]
        )
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    finally:
        native.reset()


def test_concurrent_builds_share_one_library(tmp_path):
    """The ranks of one launch may start at once on an empty cache: one of them compiles (they take turns
    on a lock, so not every rank spends the compile), every process gets a working kernel, and nothing
    but the library is left in the cache."""
    code = (
        "import torch\n"
        "from dflash_trainer.loss import native\n"
        "assert native.load() is not None, native.BUILD_ERROR\n"
        "print(native.exp_f32(torch.zeros(1)).item(), native.BUILD_SECONDS is not None)\n"
    )
    env = dict(os.environ, **{native.CACHE_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert all(out.split()[0] == "1.0" for out, _ in outs)
    assert sorted(out.split()[1] for out, _ in outs) == ["False", "False", "True"]  # one compiled
    libraries = list(tmp_path.iterdir())
    assert len(libraries) == 1 and libraries[0].suffix == ".so", libraries  # no temporary or lock files left


@NATIVE_BUILDS
def test_native_exp_is_accurate(build):
    """The kernel's branch-free float exp: within its derived bound (``tolerances.kernel_exp_error``:
    Horner's rounding, truncation, range reduction) of exp over its range, 0 below it, NaN kept."""
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_001, dtype=F64), torch.tensor([0.0, -1e-30, 1e-30], dtype=F64)])
    x32 = x.float()
    got = native.exp_f32(x32).double()
    want = torch.exp(x32.double())
    rel = ((got - want).abs() / want).max().item()
    assert rel <= tolerances.kernel_exp_error(), rel  # 1.5e-6; float's own rounding is 6e-8
    edge = native.exp_f32(torch.tensor([-87.5, -100.0, -float("inf"), float("nan")]))
    assert edge[1].item() == 0.0 and edge[2].item() == 0.0 and math.isnan(edge[3].item())
    assert 0.0 <= edge[0].item() < 1.2e-38


@NATIVE_BUILDS
def test_native_kernel_rows_do_not_depend_on_threads(build):
    """Rows are independent: the kernel gives the same bits on one thread or several (a bf16 head, KL at
    T != 1, a softcap: every loop variant that reads the stored exponentials)."""
    g = torch.Generator().manual_seed(0)
    zs, zt = (torch.randn(37, 3000, generator=g).mul(3).bfloat16() for _ in range(2))
    labels, coef = torch.randint(0, 3000, (37,), generator=g), torch.rand(37, generator=g)
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            for softcap in (None, 4.0):
                grad = torch.empty_like(zs)
                terms = LossTerms(kl_weight=0.3, temperature=1.7, cap_temperature=0.8, logit_scale=0.9, softcap=softcap)
                rows = native.chunk_epilogue(zs, zt, labels, coef, grad, terms)
                results.append([*rows, grad])
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(results[:2], results[2:]):
        for a, b in zip(one, three):
            assert torch.equal(a, b)


@NATIVE_BUILDS
def test_native_kernel_without_openmp_splits_rows_over_python_threads(monkeypatch, tmp_path, build):
    """A compiler without OpenMP builds the kernel single-threaded; Python threads then split the rows
    (a ctypes call releases the GIL) and give the OpenMP build's results bit for bit."""
    g = torch.Generator().manual_seed(1)
    zs, zt = (torch.randn(29, 2000, generator=g).mul(3).bfloat16() for _ in range(2))
    labels, coef = torch.randint(0, 2000, (29,), generator=g), torch.rand(29, generator=g)
    threads = torch.get_num_threads()

    def rows():
        grad = torch.empty_like(zs)
        terms = LossTerms(kl_weight=0.3, temperature=1.7, cap_temperature=0.8, logit_scale=0.9)
        return [*native.chunk_epilogue(zs, zt, labels, coef, grad, terms), grad]

    try:
        torch.set_num_threads(3)
        with_openmp = rows()
        isa = native.selected_isa()  # the same -march as the OpenMP build, without -fopenmp
        monkeypatch.setattr(
            native, "OPTIONAL_FLAGS", {isa: tuple(f for f in native.OPTIONAL_FLAGS[isa] if "-fopenmp" not in f)}
        )
        monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
        native.reset()
        assert native.load() is not None and native.load().dflash_openmp() == 0, native.BUILD_ERROR
        without = rows()
    finally:
        torch.set_num_threads(threads)
        native.reset()
    for a, b in zip(with_openmp, without):
        assert torch.equal(a, b)


@COMPILED
def test_non_finite_logits_give_a_non_finite_loss(compiled):
    """A NaN in the student's hidden states must surface as a NaN loss (the trainer's finite check),
    not vanish in a clamp or a max."""
    hs, ht, w_head, labels, weights, _ = make_inputs()
    bad = hs.detach().clone()
    bad[3, 0] = float("nan")
    loss, _ = fused_draft_loss(bad, ht, w_head, labels, weights, TERMS["combined_T"], compile=compiled)
    assert not math.isfinite(loss.item())


def test_grad_output_scaling_and_retain_graph():
    hs, ht, w_head, labels, weights, _ = make_inputs()
    loss, _ = fused_draft_loss(hs, ht, w_head, labels, weights, TERMS["combined_T"])
    (g1,) = torch.autograd.grad(loss, hs, retain_graph=True)
    # k times the gradient two ways: each within k times tolerances.fused_loss_float64_apart of k times
    # the exact one, and k g1's own rounding (and the accumulation's, for the second backward) one unit each
    _, grad_bound, _ = tolerances.fused_loss_float64_apart(hs, ht, w_head, labels, weights, TERMS["combined_T"])
    u = tolerances.unit_roundoff(F64)
    (3 * loss).backward(retain_graph=True)
    assert ((hs.grad - 3 * g1).abs() <= 3 * grad_bound + u * (3 * g1).abs()).all()
    loss.backward()  # second backward through the same graph
    assert ((hs.grad - 4 * g1).abs() <= 4 * grad_bound + 2 * u * (4 * g1).abs()).all()


def test_upstream_graph_receives_gradient():
    """The loss sits at the end of a real graph: a linear layer in front gets the right grads."""
    hs, ht, w_head, labels, weights, _ = make_inputs()
    layer = torch.nn.Linear(16, 16, dtype=F64)
    x = hs.detach()
    fused, _ = fused_draft_loss(layer(x), ht, w_head, labels, weights, TERMS["combined_T1"])
    gf = torch.autograd.grad(fused, layer.weight)[0]
    ref, _ = reference_draft_loss(layer(x), ht, w_head, labels, weights, TERMS["combined_T1"])
    gr = torch.autograd.grad(ref, layer.weight)[0]
    # the weight's gradient is dh^T x: the loss's gradient bound on dh carried through that GEMM (over the
    # N rows), plus the GEMM's own rounding on each side
    h = layer(x).detach()
    _, grad_bound, _ = tolerances.fused_loss_float64_apart(h, ht, w_head, labels, weights, TERMS["combined_T1"])
    (dh,) = torch.autograd.grad(
        reference_draft_loss(h.requires_grad_(), ht, w_head, labels, weights, TERMS["combined_T1"])[0], h
    )
    n = x.shape[0]
    bound = grad_bound.T @ x.abs() + 2 * tolerances.gamma(n, F64) * (dh.abs().T @ x.abs())
    assert ((gf - gr).abs() <= bound).all()


def test_per_slot_metrics_sum_to_totals():
    hs, ht, w_head, labels, weights, slots = make_inputs()
    _, m = fused_draft_loss(hs, ht, w_head, labels, weights, LossTerms(kl_weight=0.2), slot_ids=slots, num_slots=5)
    per = m["per_slot"]
    assert per["rows"].sum().item() == m["rows"].item() == int((weights > 0).sum())
    # the per-slot means, weighted back by their rows, against the overall mean: sums of at most N rows
    # and 5 slots, a product and a division on each side; CE >= 0, so every sum's absolute values are
    # at most its count times the largest slot mean
    bound = 2 * tolerances.gamma(hs.shape[0] + 8, F64) * per["ce"].abs().max().item()
    assert abs((per["ce"] * per["rows"]).sum().item() / m["rows"].item() - m["ce"].item()) <= bound
    assert per["accuracy"].shape == (5,)


def test_no_grad_does_no_gradient_work():
    hs, ht, w_head, labels, weights, _ = make_inputs()
    with_grad, _ = fused_draft_loss(hs, ht, w_head, labels, weights, TERMS["combined_T1"])
    with torch.no_grad(), OpRecorder() as rec:
        loss, _ = fused_draft_loss(hs, ht, w_head, labels, weights, TERMS["combined_T1"], chunk_size=100)
    assert (
        abs(loss.item() - with_grad.item())
        <= tolerances.fused_loss_float64_apart(hs, ht, w_head, labels, weights, TERMS["combined_T1"])[0]
    )
    assert rec.count("mm") == 2  # student and teacher logits; no G @ W
    with torch.no_grad(), OpRecorder() as rec:
        fused_draft_loss(hs, None, w_head, labels, weights, chunk_size=100)
    assert rec.count("mm") == 1  # CE with data labels: the teacher GEMM is skipped


def assert_within_derived_bounds(loss, grad, ref, ref_grad, hs64, ht64, w64, labels, weights, dtype, terms, what=""):
    """The fast loss and gradient (inputs rounded to ``dtype``, loss ``terms``) within
    ``tolerances.fused_loss_error`` of the float64 reference: elementwise for the gradient, plus the
    gradient's own rounding to ``dtype``."""
    loss_error, grad_error, _ = tolerances.fused_loss_error(hs64, ht64, w64, labels, weights, dtype, terms)
    assert abs(loss.item() - ref.item()) <= loss_error, (what, abs(loss.item() - ref.item()), loss_error)
    grad_error = grad_error + tolerances.unit_roundoff(dtype) * ref_grad.abs() * (dtype != torch.float32)
    err = (grad.double() - ref_grad).abs()
    assert (err <= grad_error).all(), (what, (err / grad_error).max().item())


@KERNELS
def test_bf16_deviation_is_bounded(compiled):
    """bf16 inputs and head with fp32 logits against the float64 reference, within the derived bounds."""
    hs64, ht64, w64, labels, weights, _ = make_inputs(n=64, h=32, v=200)
    terms = TERMS["combined_T"]
    ref, _ = reference_draft_loss(hs64, ht64, w64, labels, weights, terms)
    (ref_grad,) = torch.autograd.grad(ref, hs64)
    hs = hs64.detach().bfloat16().requires_grad_()
    loss, _ = fused_draft_loss(
        hs, ht64.bfloat16(), w64.bfloat16(), labels, weights.bfloat16(), terms, compile=compiled, chunk_size=24
    )
    loss.backward()
    assert loss.dtype == torch.float32 and hs.grad.dtype == torch.bfloat16
    assert_within_derived_bounds(loss, hs.grad, ref, ref_grad, hs64, ht64, w64, labels, weights, torch.bfloat16, terms)


@NATIVE_BUILDS
def test_native_float32_matches_the_float64_reference(build):
    """The float path (fast exp, block sums) against float64, every term, within the derived fp32 bounds."""
    for name in ("combined_T", "softcap_scale", "cap_tempered"):
        terms = TERMS[name]
        hs64, ht64, w64, labels, weights, _ = make_inputs(n=64, h=32, v=3000)
        ref, ref_m = reference_draft_loss(hs64, ht64, w64, labels, weights, terms)
        (ref_grad,) = torch.autograd.grad(ref, hs64)
        hs = hs64.detach().float().requires_grad_()
        loss, m = fused_draft_loss(hs, ht64.float(), w64.float(), labels, weights.float(), terms, compile="native")
        loss.backward()
        assert_within_derived_bounds(
            loss, hs.grad, ref, ref_grad, hs64, ht64, w64, labels, weights, torch.float32, terms, name
        )
        *_, term_error = tolerances.fused_loss_error(hs64, ht64, w64, labels, weights, torch.float32, terms)
        for key in ("ce", "kl", "cap"):
            assert abs(m[key].item() - ref_m[key].item()) <= term_error, (name, key)


def test_weights_schedules():
    w = slot_weights(16, 7.0)
    # exp of (1 - 8) / 7 in float64 (the exponent rounds once, exp within an ulp): a few units of e^-1
    assert w[0] == 0 and w[1] == 1 and abs(w[8].item() - math.exp(-1.0)) <= 4 * tolerances.unit_roundoff(F64)
    assert torch.all(w[2:] < w[1:-1])
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        slot_weights(1, 4.0)


def test_chunk_size_from_memory_budget():
    assert chunk_rows(32000, None, 32000 * 26 * 10) == 10
    assert chunk_rows(32000, 5, None) == 5
    with pytest.raises(ValueError, match="below one row's workspace"):
        chunk_rows(32000, None, 1000)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda a: a.update(teacher_hidden=a["teacher_hidden"][:, :3]),
            r"teacher_hidden must be shaped like student_hidden \(41, 16\)",
        ),
        (lambda a: a.update(lm_head_weight=a["lm_head_weight"][:, :3]), r"lm_head_weight must be \[V, 16\]"),
        (lambda a: a.update(lm_head_weight=a["lm_head_weight"].float()), "lm_head_weight.dtype must be torch.float64"),
        (lambda a: a.update(lm_head_weight=a["lm_head_weight"].clone().requires_grad_()), "head is frozen"),
        (lambda a: a.update(labels=a["labels"] + 1000), r"labels must be token ids in \[0, 60\)"),
        (lambda a: a.update(weights=-a["weights"]), "weights must be finite and >= 0"),
        (lambda a: a.update(weights=a["weights"][:5]), r"weights must be a floating \[41\] tensor"),
        (
            lambda a: a.update(teacher_hidden=None, terms=LossTerms(kl_weight=0.1)),
            "fused_draft_loss: teacher_hidden must be given for KL, teacher labels or pair terms",
        ),
        (lambda a: a.update(terms=LossTerms(kl_weight=1.5)), r"LossTerms: kl_weight must be in \[0, 1\]"),
    ],
)
def test_bad_input_names_the_argument(change, message):
    hs, ht, w_head, labels, weights, _ = make_inputs()
    args = {"teacher_hidden": ht, "lm_head_weight": w_head, "labels": labels, "weights": weights, "terms": None}
    with pytest.raises(ValueError, match=message):  # the terms refuse a bad value when they are built
        change(args)
        fused_draft_loss(
            hs, args["teacher_hidden"], args["lm_head_weight"], args["labels"], args["weights"], args["terms"]
        )


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: LossTerms(kl_weight=-0.1), r"kl_weight must be in \[0, 1\]"),
        (lambda: LossTerms(temperature=0.0), "temperature must be > 0"),
        (lambda: LossTerms(cap_temperature=-1.0), "cap_temperature must be > 0"),
        (lambda: LossTerms(cap_weight=-0.1), "cap_weight must be >= 0"),
        (lambda: LossTerms(label_source="model"), "label_source must be 'data' or 'teacher'"),
        (lambda: LossTerms(logit_scale=0.0), "logit_scale must be a nonzero number"),
        (lambda: LossTerms(softcap=0.0), "softcap must be None or > 0"),
        (lambda: LossTerms(temperature=float("nan")), "temperature must be > 0"),
        (
            lambda: LossTerms(pair_terms=(PairTerm("a", "overlap"), PairTerm("a", "renyi_half"))),
            "pair term names must be distinct",
        ),
        (lambda: LossTerms(pair_terms=({"name": "tv"},)), "pair_terms must be PairTerm objects"),
        (lambda: PairTerm("tv", "total_variation"), "pair term tv's statistic must be one of"),
        (lambda: PairTerm("tv", "overlap", weight=-1.0), "pair term tv's weight must be a number >= 0"),
        (lambda: PairTerm("tv", "overlap", scale=float("inf")), "pair term tv's scale must be finite"),
        (lambda: PairTerm("not a name", "overlap"), "a pair term's name must be an identifier"),
        (lambda: BlockCredit("overlap", 0.0), r"credit.alpha must be in \(0, 1\]"),
        (lambda: BlockCredit("entropy"), "credit.confidence must be one of"),
    ],
)
def test_loss_terms_refuse_bad_values(build, message):
    """The terms are checked once, when they are built, and the error names the field."""
    with pytest.raises(ValueError, match=f"LossTerms: {message}"):
        build()


def test_loss_terms_cross_the_op_as_json():
    terms = LossTerms(
        kl_weight=0.3,
        softcap=2.5,
        pair_terms=[PairTerm("tv", "overlap", weight=0.5, scale=-1.0, offset=1.0)],
        credit=BlockCredit("label_prob", 0.4),
        top_k=3,
    )
    assert isinstance(terms.pair_terms, tuple)  # a list given is kept as a tuple
    assert LossTerms.from_json(terms.to_json()) == terms
    assert not terms.kernel_ready and terms.needs_teacher  # a weighted overlap term: the eager passes


class OpRecorder(TorchDispatchMode):
    """Records every ATen op and the element count of every tensor it returns."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inner = fused.IMPLEMENTATIONS.get(func.overloadpacket._qualified_op_name)
        if inner is not None:  # the loss's custom ops are opaque to the mode: record what runs inside them
            with self:
                return inner(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket.__name__)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out

    def count(self, name):
        return sum(op == name for op in self.ops)


@COMPILED
def test_never_allocates_positions_by_vocab(compiled):
    n, h, v = 4096, 64, 32000
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ht = torch.randn(n, h, generator=g)
    w_head = torch.randn(v, h, generator=g) * 0.1
    labels = torch.randint(0, v, (n,), generator=g)
    weights = torch.ones(n)
    # A dispatch mode sees every torch op (the native kernel's own scratch is 3 rows of V per thread).
    with OpRecorder() as rec:
        loss, _ = fused_draft_loss(
            hs,
            ht,
            w_head,
            labels,
            weights,
            LossTerms(kl_weight=0.15, temperature=2.0, cap_weight=0.1),
            chunk_size=256,
            compile=compiled,
        )
        loss.backward()
    assert rec.count("mm") >= 3 * (n // 256)  # the work really ran, chunk by chunk
    assert rec.largest < n * v, f"a tensor with {rec.largest} elements (N x V = {n * v}) was allocated"
    assert rec.largest <= 256 * v
    assert torch.isfinite(hs.grad).all()


def test_logit_options_follow_the_target_config():
    from transformers import CohereConfig, Gemma2Config, Qwen3Config

    from dflash_trainer.model.target import head_logit_options

    assert head_logit_options(Qwen3Config()) == {"logit_scale": 1.0, "softcap": None}
    assert head_logit_options(Gemma2Config()) == {"logit_scale": 1.0, "softcap": 30.0}
    assert head_logit_options(CohereConfig()) == {"logit_scale": 0.0625, "softcap": None}
