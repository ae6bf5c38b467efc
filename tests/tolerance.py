"""The suite's one rule for numerical tolerances: how a bound is chosen, in one place.

Every numerical comparison in the suite sets two computations of the same mathematical
quantity side by side. Which bound applies depends only on how the two differ:

1. **Same operations in the same order** (a resume against an uninterrupted run, a
   reshard that only moves bytes, ZeRO partitions that add the same numbers in the same
   order): the results are identical. Assert ``torch.equal`` / ``==`` (:data:`EXACT`).

2. **One evaluation, reduction in another order** (a matmul split over tp ranks, a
   chunked loss, a sum over dp ranks, another CPU kernel's blocking) from identical
   inputs: :func:`evaluation`. A sum of ``n`` terms rounded in another order moves by
   about ``sqrt(n) u`` relative to the sum of the terms' magnitudes (Higham and Mary's
   probabilistic bound, "A New Approach to Probabilistic Rounding Error Analysis", SIAM
   J. Sci. Comput. 2019: ``lambda sqrt(n) u`` with ``lambda`` a few), where ``u`` is the
   unit roundoff of the dtype the sums are carried in (:data:`UNIT_ROUNDOFF`). ``n`` is
   the longest reduction whose order changed; the suite's tiny models have inner
   dimensions of at most :data:`WIDTH`.

3. **A training trajectory** (losses, a whole model's parameters after ``k`` optimizer
   steps) where each step is such an evaluation: :func:`trajectory`. Each step seeds a
   fresh rounding difference in the gradient, and the optimizer turns it into a parameter
   difference. Adam's update ``m / (sqrt(v) + eps)`` is normalised: a gradient element of
   relative rounding error ``e`` (``e ~ c kappa u``, with ``c`` the number of reductions of
   changed order along one backward path and ``kappa`` the element's condition number,
   the sum of its terms' magnitudes over its value) moves its update by about ``e``, so a
   step of learning rate ``lr`` moves parameters of scale ``s`` by about
   ``(lr / s) c kappa u`` normwise. Summed over the steps::

       bound = MARGIN * u * (sqrt(width) + ADAM_ULPS * sum(lr_t) / s)

   ``ADAM_ULPS`` stands for ``c kappa``: ``c ~ 6`` (the forward GEMM, the two backward
   GEMMs, the norms, the reduction over ranks) and ``kappa ~ 8`` (a weight gradient sums
   16-64 token contributions of random sign: ``kappa ~ sqrt(tokens)``), so 48; the
   largest drift measured per unit of ``sum(lr) / s`` is 46 u (below). ``s`` is the
   scale of the parameters the optimizer moves (the models' init std, 0.02: the smallest
   scale, so the largest relative bound). The bound depends on the learning rate and the
   number of steps, not on the number of processes or the layout: parity tests at lr
   1e-2 get wider bounds than at 1e-3.

   Normwise over the whole model, never elementwise: an element whose gradient cancels
   to ~eps has an update that flips with its last bits (up to ``2 lr`` a step), so an
   elementwise bound after Adam steps is either ~lr or a coin toss.

   Per tensor, :func:`per_tensor`: the differences sit wherever a gradient nearly cancels,
   spread over the model like its elements, so a tensor holding ``n`` of the model's ``N``
   elements fluctuates around the model's figure by up to ``sqrt(N / n)`` (one sensitive
   element landing in a small bias).

``MARGIN`` (4, two bits) is the written margin over the model above, which was checked
against the spread measured across CPU kernels and thread counts: on a 2-core AMD EPYC
(AVX-512, no AMX), ``ATEN_CPU_CAPABILITY`` default / avx2 / avx512 x ``MKL_CBWR`` unset /
COMPATIBLE (another MKL GEMM kernel) x 1 / 2 threads per rank, and the figures an Intel
Xeon with AMX measured (issue 42). The largest: 1.4e-6 relative for Llama's sequence
classifier at tp 2 after 20 steps at lr 1e-3 (bound 1.3e-5) and 1.37e-6 for a Llama
after one step at lr 1e-2 (46 u per unit of ``lr / s``; bound 7.6e-6).
``tests/test_tolerance.py`` keeps those figures beside their bounds, and
``tools/kernel_matrix.py`` measures them again; CI runs the parity tests a second time
under another kernel choice and thread count (``.ci/run``).

The other bounds follow from these: one step's gradients (:func:`gradient`, the
evaluation times a gradient sum's condition), a gradient or a gradient norm computed from
weights within a bound (:func:`gradient_from`, :func:`norm_from`), an output through
``d`` linear maps of such weights (:func:`composed`), SGD's per-element step as the rate of
:func:`trajectory` (:func:`sgd_rate`), a low-precision run against fp32
(:func:`against_fp32`). The ``check*`` functions assert and record each comparison
(``$MESHTRAIN_TOLERANCE_LOG``) so ``tools/kernel_matrix.py`` can show it beside its bound.

Bounds wider than these rules give are allowed only with their own derivation written
beside the assertion (bf16 runs against an fp32 reference, a quantized base, an
approximation such as fp8).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

UNIT_ROUNDOFF = {  # half the distance from 1 to the next number: 2^-(mantissa bits + 1)
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}
MARGIN = 4.0
ADAM_ULPS = 48.0
WIDTH = 64  # the widest inner dimension of the suite's tiny models
INIT_STD = 0.02  # the init std of the suite's models (Decoder, transformers' configs)
# A weight gradient sums 16-64 token contributions of random sign: its condition number
# (the sum of the terms' magnitudes over its value) is about sqrt(tokens), the kappa of
# ADAM_ULPS = c kappa.
GRADIENT_CONDITION = 8.0
# The suite's tiny models start training with whole-model gradient norms below 2 (the
# Decoder, Llama and GPT-2 of the parity tests: 1.0-1.9) and the norms fall as they train;
# 4 leaves a margin of 2.
GRAD_NORM = 4.0
# bf16 against fp32 (Decoder and Llama, 20 steps, tp 2 and 4) measured: losses 2.1e-4,
# whole-model parameters 2.9e-3 (0.75 u), the worst tensor, the embedding, 1.3e-2 (3.3 u).
LOW_PRECISION_ROUNDINGS = 5.0

LOG_ENV = "MESHTRAIN_TOLERANCE_LOG"  # a JSONL file every check appends to (the matrix job)


def unit_roundoff(dtype: object = "float32") -> float:
    """The unit roundoff ``u`` of a dtype (a torch dtype or its name)."""
    name = str(dtype).removeprefix("torch.")
    return UNIT_ROUNDOFF[name]


def evaluation(*, width: int = WIDTH, dtype: object = "float32") -> float:
    """Relative bound for one evaluation whose reductions ran in another order."""
    return MARGIN * math.sqrt(width) * unit_roundoff(dtype)


def gradient(*, width: int = WIDTH, dtype: object = "float32") -> float:
    """Relative bound (normwise per tensor) for one step's gradients from identical weights
    whose reductions ran in another order: :func:`evaluation` times the condition of a
    gradient sum (:data:`GRADIENT_CONDITION`)."""
    return GRADIENT_CONDITION * evaluation(width=width, dtype=dtype)


def trajectory(
    lr: float | Sequence[float],
    steps: int | None = None,
    *,
    scale: float = INIT_STD,
    width: int = WIDTH,
    dtype: object = "float32",
) -> float:
    """Relative bound on losses and a whole model's parameters (normwise) after Adam steps.

    ``lr`` is the learning rate of every step (with ``steps``) or the list of the rates
    the schedule used.
    """
    if isinstance(lr, (int, float)):
        if steps is None:
            raise TypeError("trajectory(lr, steps): a constant rate needs the step count")
        lr_sum = float(lr) * steps
    else:
        lr_sum = float(sum(lr))
    u = unit_roundoff(dtype)
    return MARGIN * u * (math.sqrt(width) + ADAM_ULPS * lr_sum / scale)


def sgd_rate(
    lr: float, numel: int, *, momentum: float = 0.0, grad_norm: float = GRAD_NORM
) -> float:
    """The per-element step of SGD, to use as :func:`trajectory`'s rate.

    Adam moves every element by about ``lr`` a step, whatever its gradient; SGD moves it
    by ``lr g`` (``lr g / (1 - momentum)`` once momentum has built up), so its rounding
    differences enter the parameters at the rms gradient ``grad_norm / sqrt(numel)``
    times that, with the same relative size ``c kappa u`` (``ADAM_ULPS``)."""
    return lr * grad_norm / math.sqrt(numel) / (1.0 - momentum)


def per_tensor(model_bound: float, model_numel: int, tensor_numel: int) -> float:
    """The relative bound for one tensor of a model held to ``model_bound`` normwise."""
    return model_bound * math.sqrt(model_numel / max(tensor_numel, 1))


def composed(model_bound: float, depth: int, *, width: int = WIDTH) -> float:
    """Relative bound on an output computed through ``depth`` linear maps whose weights are
    each within ``model_bound`` (first-order perturbation of a product of ``depth``
    factors), plus the output's own evaluation in another order."""
    return depth * model_bound + evaluation(width=width)


def gradient_from(param_bound: float) -> float:
    """Relative bound on a gradient computed from weights within ``param_bound``: first
    order through the forward and the backward maps (twice the bound), plus its own
    evaluation in another order (:func:`gradient`)."""
    return 2.0 * param_bound + gradient()


def norm_from(param_bound: float, numel: int) -> float:
    """Relative bound on a global gradient norm over ``numel`` elements computed from weights
    within ``param_bound``: the gradients' bound (:func:`gradient_from`) plus the norm's own
    sum of ``numel`` squares in another order (an engine's fp32 ``vector_norm`` over one
    flat buffer against a sum of per-shard squares)."""
    return gradient_from(param_bound) + evaluation(width=numel)


def against_fp32(dtype: object) -> float:
    """Relative bound for a run computing in ``dtype`` (fp32 masters) against the same run
    in fp32: a few roundings of relative ``u(dtype)`` in the activations that do not cancel
    (``LOW_PRECISION_ROUNDINGS``), and no growth with the steps, because the fp32 masters
    keep every update exact."""
    return LOW_PRECISION_ROUNDINGS * unit_roundoff(dtype)


def normwise(state: dict, ref_state: dict) -> float:
    """||a - b||_2 / ||b||_2 over every tensor of two state dicts (in float64)."""
    assert state.keys() == ref_state.keys(), sorted(set(state) ^ set(ref_state))
    num = sum(float((state[k].double() - ref_state[k].double()).pow(2).sum()) for k in state)
    den = sum(float(ref_state[k].double().pow(2).sum()) for k in state)
    return (num / max(den, 1e-300)) ** 0.5


def relative(a, b) -> float:
    """||a - b|| / ||b|| of two arrays or tensors (numpy or torch), in float64."""
    import numpy as np

    a64 = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
    b64 = np.asarray(b.detach().cpu() if hasattr(b, "detach") else b, dtype=np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))


def record(what: str, measured: float, bound: float) -> None:
    """Append one comparison to ``$MESHTRAIN_TOLERANCE_LOG`` (when set) for the matrix job."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    import torch

    from tests.harness import RANK_THREADS_ENV

    row = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0],
        "what": what,
        "measured": float(measured),
        "bound": float(bound),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "env": {
            k: os.environ.get(k, "")
            for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS", RANK_THREADS_ENV)
        },
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def check(what: str, measured: float, bound: float) -> None:
    """Assert ``measured <= bound``, recording both first."""
    record(what, measured, bound)
    assert measured <= bound, f"{what}: {measured:.4e} > bound {bound:.4e}"


def check_trajectory(
    what: str,
    run: tuple[Sequence[float], dict],
    reference: tuple[Sequence[float], dict],
    bound: float,
) -> None:
    """Per-step losses (relative) and the whole model (normwise) of ``run`` within
    ``bound`` of ``reference``; each is ``(losses, state_dict)``."""
    losses, state = run
    ref_losses, ref_state = reference
    assert len(losses) == len(ref_losses), (what, losses, ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        check(f"{what}: loss at step {step}", abs(a - b) / abs(b), bound)
    check(f"{what}: parameters (normwise)", normwise(state, ref_state), bound)


def check_run(what: str, run: tuple, reference: tuple, bound: float) -> None:
    """``(losses, grad_norms, params)`` of a run against the reference's: every loss within
    ``bound`` (relative), every gradient norm within :func:`norm_from` it, every
    parameter tensor within :func:`per_tensor` of it (normwise). ``params`` may hold only
    this rank's tensors (a pipeline stage); ``grad_norms`` may be ``None``."""
    losses, norms, params = run
    ref_losses, ref_norms, ref_params = reference
    assert len(losses) == len(ref_losses), (what, losses, ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        check(f"{what}: loss at step {step}", abs(a - b) / abs(b), bound)
    numel = sum(t.numel() for t in ref_params.values())
    if norms is not None:
        for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
            check(f"{what}: gradient norm at step {step}", abs(a - b) / b, norm_from(bound, numel))
    for name, t in params.items():
        ref = ref_params[name]
        err = float((t.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))
        check(f"{what}: {name}", err, per_tensor(bound, numel, t.numel()))


def check_weights(
    what: str,
    state: dict,
    ref_state: dict,
    bound: float,
    *,
    noise: Sequence[str] = (),
    lr_sum: float = 0.0,
) -> None:
    """A trained model's tensors against the reference's: the whole model normwise within
    ``bound``, and every tensor within :func:`per_tensor` of it.

    ``noise`` names tensors whose exact gradient is zero (an attention key bias: adding a
    constant to every key shifts each query's scores by a constant, which softmax
    ignores), so both runs train them on rounding noise that Adam normalises into steps of
    up to ``lr`` each, different noise in each run: they are held elementwise to
    ``2 lr_sum``, the most two such runs can part, instead of relatively."""
    check(f"{what}: whole model (normwise)", normwise(state, ref_state), bound)
    numel = sum(t.numel() for t in ref_state.values())
    for name, ref in ref_state.items():
        t = state[name]
        assert t.shape == ref.shape, (what, name, t.shape, ref.shape)
        if any(name.endswith(n) for n in noise):
            assert lr_sum > 0, "a noise-only tensor needs the run's lr_sum"
            check(f"{what}: {name} (noise only)", float((t - ref).abs().max()), 2 * lr_sum)
            continue
        err = float((t.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))
        check(f"{what}: {name}", err, per_tensor(bound, numel, ref.numel()))
