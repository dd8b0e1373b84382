"""SDE transitions of flow-matching samplers, with the Gaussian log-prob of each transition.

GRPO on a flow-matching model turns the deterministic Euler sampler into a stochastic one so
that every denoising step is a policy action with a density. One step maps the latent ``x`` at
noise level ``s`` and the model's velocity ``v`` to the latent ``x'`` at level ``s'`` (``s' <
s``) by ``x' = mu(x, v) + std * eps``; its log-prob ``log N(x'; mu, std^2)`` (mean over the
non-batch dimensions) is what the PPO ratio and the policy gradient are built from. The sample
is always detached: the gradient reaches the weights only through ``mu``.

Three variants, written from the formulas of FlowGRPO (``flow_grpo/diffusers_patch/
sd3_sde_with_logprob.py``, ``sde_type="sde"`` and ``"cps"``) and DanceGRPO (``flux_step`` in
``fastvideo/train_grpo_flux.py``); see ``docs/leangrpo.md`` section 2:

``flow_grpo``
    ``std_dev_t = eta*sqrt(s/(1 - s))`` (with ``s == 1`` replaced by ``sigma_max`` in the
    denominator; FlowGRPO uses ``sigmas[1]``), ``mu = x*(1 + std_dev_t^2/(2s)*dt) +
    v*(1 + std_dev_t^2*(1-s)/(2s))*dt`` with ``dt = s' - s``, transition std
    ``std_dev_t*sqrt(-dt)``, Gaussian log-prob.
``flow_grpo_cps``
    ``std_dev_t = s'*sin(eta*pi/2)`` is the transition std, ``x0 = x - s*v``,
    ``x1 = x + (1-s)*v``, ``mu = x0*(1-s') + x1*sqrt(s'^2 - std_dev_t^2)``,
    ``log_prob = -mean((x' - mu)^2)`` (FlowGRPO drops every constant and the ``1/(2 std^2)``
    factor; so do we, to stay comparable).
``dance_grpo``
    ``x0 = x - s*v``, ``score = -(x - x0*(1-s))/s^2``,
    ``mu = x + ds*v + (-eta^2/2*score)*ds`` with ``ds = s' - s``, std ``eta*sqrt(s - s')``,
    Gaussian log-prob, constants included. (DanceGRPO's code before its 2025-08 fix left out
    ``-log(std) - log(sqrt(2 pi))``: the line subtracting them was a separate expression
    statement; its current code keeps them, as we do. They do not depend on the weights, so
    ratios and gradients were the same either way.)

Why the noise is an argument: drawing it here would put a random op in every traced step, and
the LeanGRPO schedules need the rollout and a later re-score to see the same transition. The
caller draws ``noise`` (standard normal, shaped like the latents) when sampling, or passes the
recorded ``prev_sample`` when scoring. Everything is float32 (bf16 overflows in ``mu``, which is
why both repos upcast), branch-free on tensor values and free of ``.item()``, so the function
traces under ``torch.compile(fullgraph=True)``.

Zero std. With ``eta == 0`` every kind is the deterministic Euler step ``x' = x + (s' - s)*v``
(the same expression, bit for bit, as diffusers' ``FlowMatchEulerDiscreteScheduler.step``) and
``log_prob`` is zeros: the transition is a point mass and carries no policy gradient. With
``eta > 0`` the Gaussian kinds have a zero std only on a degenerate step (``s' == s``); there too
``log_prob`` is 0 (computed with a stand-in std of 1, so neither value nor gradient is NaN).
``flow_grpo_cps`` has std 0 at the final step (``s' = 0``); its log-prob has no ``1/std``
factor, so it stays finite as in FlowGRPO (0 for the sample drawn, ``-mean((x'-mu)^2)`` for a
given one). For reference: FlowGRPO's ``sde`` returns NaN at ``noise_level=0`` (``0/0`` plus
``-log 0``) and its pipelines only ever discard those log-probs; DanceGRPO's ``flux_step``
divides by zero at ``eta=0``. At the final step (``s' = 0``) both Gaussian kinds keep a positive
std (``flow_grpo``: ``eta*s/sqrt(1-s)``, ``dance_grpo``: ``eta*sqrt(s)``), but both repos leave
that step out of training: FlowGRPO with ``timestep_fraction=0.99`` (and its Fast pipeline's
default window ``(0, T - 1)``, commented there as "the last Gaussian is too sharp and
overflows"), DanceGRPO by slicing ``[:, :-1]`` before choosing steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SDE_KINDS", "SDEStep", "sde_step", "kl_to_reference"]

SDE_KINDS = ("flow_grpo", "flow_grpo_cps", "dance_grpo")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(kw_only=True)
class SDEStep:
    """One transition ``x -> x'`` and its log-prob. All tensors are float32."""

    prev_sample: Tensor
    """``x'``, shaped like the latents and detached: the sample drawn from ``noise``, the
    ``prev_sample`` that was passed in for scoring, or ``mean`` when the step is deterministic."""

    log_prob: Tensor
    """Shape ``[B]``: the transition log-prob of ``prev_sample``, averaged over the non-batch
    dimensions. Differentiable through ``mean`` only."""

    mean: Tensor
    """``mu``, shaped like the latents; carries the gradient to the velocity."""

    std: Tensor
    """The std of the transition (the one ``prev_sample`` is drawn with), shaped ``[B, 1, ...]``
    (or 0-dim when the sigmas are scalars), broadcastable to the latents."""

    kl_std: Tensor
    """The std FlowGRPO divides its KL loss by: the ``std_dev_t`` that its
    ``sde_step_with_logprob`` returns. For ``flow_grpo`` that is ``eta*sqrt(s/(1-s))``, without
    the ``sqrt(s - s')`` factor of ``std`` (so FlowGRPO's KL is the Gaussian KL times
    ``s - s'``); for ``flow_grpo_cps`` it equals ``std``; DanceGRPO has no KL term, and for
    ``dance_grpo`` it equals ``std`` (the exact Gaussian KL). Pass it to ``kl_to_reference`` to
    reproduce FlowGRPO's ``beta``."""


def _check_kind(kind: str) -> None:
    if kind not in SDE_KINDS:
        raise ValueError(f"kind={kind!r} is not a known SDE; use one of {SDE_KINDS}")


def _per_sample(value, x: Tensor, name: str, x_name: str = "latents") -> Tensor:
    """A per-sample scalar (a sigma, a std) as float32 on ``x``'s device, shaped to broadcast
    per sample against ``x``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
        raise TypeError(
            f"{name} must be a Python float or a tensor of shape [B] or []; "
            f"got {type(value).__name__}")
    if not isinstance(value, Tensor):
        return torch.tensor(float(value), dtype=torch.float32, device=x.device)
    t = value.to(device=x.device, dtype=torch.float32)
    if t.ndim == 0:
        return t
    batch = x.shape[0]
    if t.ndim == 1 and t.shape[0] in (batch, 1):
        return t.reshape(-1, *([1] * (x.ndim - 1)))
    if t.ndim == x.ndim and t.shape[0] in (batch, 1) and all(d == 1 for d in t.shape[1:]):
        return t
    raise ValueError(
        f"{name} has shape {tuple(t.shape)}; {x_name} have shape {tuple(x.shape)}: pass one "
        f"value per sample (shape [{batch}]), a 0-dim tensor, or a Python float")


def _gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """``log N(sample; mean, std^2)`` averaged over non-batch dims; 0 where ``std == 0``."""
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    elementwise = (-((sample - mean) ** 2) / (2 * safe_std**2)
                   - torch.log(safe_std) - _LOG_SQRT_2PI)
    elementwise = torch.where(positive, elementwise, torch.zeros_like(elementwise))
    return elementwise.mean(dim=tuple(range(1, elementwise.ndim)))


def sde_step(kind: str, *, latents: Tensor, velocity: Tensor, sigma, sigma_next, eta: float,
             noise: Tensor | None = None, prev_sample: Tensor | None = None,
             sigma_max=None) -> SDEStep:
    """One stochastic step of kind ``kind`` (one of ``SDE_KINDS``) from ``sigma`` to
    ``sigma_next``, sampling ``x' = mean + std*noise`` or scoring a given ``prev_sample``.

    ``latents``/``velocity``: ``[B, ...]`` (at least 2-D), any float dtype, upcast to float32.
    ``sigma``/``sigma_next``: a ``[B]`` tensor (one noise level per sample), a 0-dim tensor or a
    Python float. ``eta``: the noise level (FlowGRPO ``noise_level``, DanceGRPO ``eta``), a
    Python float ``>= 0``. ``sigma_max``: required by ``flow_grpo`` when ``eta > 0``; replaces
    ``sigma`` in ``1 - sigma`` where ``sigma == 1`` (FlowGRPO passes the schedule's
    ``sigmas[1]``). Give exactly one of ``noise`` and ``prev_sample``; with ``eta == 0`` you may
    give neither (the step is then deterministic and ``log_prob`` is zeros).
    """
    _check_kind(kind)
    if isinstance(eta, Tensor) or isinstance(eta, bool) or not isinstance(
            eta, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"eta must be a Python float (the step branches on eta == 0); "
                        f"got {type(eta).__name__}")
    if eta < 0:
        raise ValueError(f"eta={eta} is negative; the noise level must be >= 0")
    if latents.ndim < 2:
        raise ValueError(f"latents have shape {tuple(latents.shape)}; they need a batch "
                         "dimension and at least one more ([B, ...])")
    if velocity.shape != latents.shape:
        raise ValueError(f"velocity has shape {tuple(velocity.shape)} but latents have "
                         f"{tuple(latents.shape)}; they must match")
    if noise is not None and prev_sample is not None:
        raise ValueError("both noise and prev_sample were given; pass noise to draw a new "
                         "sample, or prev_sample to score an existing one, not both")
    if noise is None and prev_sample is None and eta != 0:
        raise ValueError(f"neither noise nor prev_sample was given with eta={eta}; pass "
                         "noise=torch.randn_like(latents) to sample, or prev_sample=... to "
                         "score a recorded transition")
    for name, given in (("noise", noise), ("prev_sample", prev_sample)):
        if given is not None and given.shape != latents.shape:
            raise ValueError(f"{name} has shape {tuple(given.shape)} but latents have "
                             f"{tuple(latents.shape)}; they must match")
    if kind == "flow_grpo" and eta != 0 and sigma_max is None:
        raise ValueError("kind='flow_grpo' with eta > 0 needs sigma_max (the value that "
                         "replaces sigma == 1 in sqrt(sigma/(1 - sigma))); pass the "
                         "schedule's sigmas[1], as FlowGRPO does")

    x = latents.to(torch.float32)
    v = velocity.to(torch.float32)
    s = _per_sample(sigma, x, "sigma")
    s_next = _per_sample(sigma_next, x, "sigma_next")
    given = None if prev_sample is None else prev_sample.detach().to(torch.float32)

    if eta == 0:
        # The Euler step, spelled as diffusers spells it.
        dt = s_next - s
        mean = x + dt * v
        zero = torch.zeros_like(dt)
        sample = mean.detach() if given is None else given
        log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        return SDEStep(prev_sample=sample, log_prob=log_prob, mean=mean, std=zero,
                       kl_std=zero)

    if kind == "flow_grpo":
        dt = s_next - s
        s_max = _per_sample(sigma_max, x, "sigma_max")
        std_dev_t = torch.sqrt(s / (1 - torch.where(s == 1, s_max, s))) * eta
        mean = (x * (1 + std_dev_t**2 / (2 * s) * dt)
                + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt)
        std = std_dev_t * torch.sqrt(-dt)
        kl_std = std_dev_t
    elif kind == "flow_grpo_cps":
        std = s_next * math.sin(eta * math.pi / 2)
        x0 = x - s * v
        x1 = x + v * (1 - s)
        mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std**2)
        kl_std = std
    else:  # dance_grpo
        ds = s_next - s
        x0 = x - s * v
        score = -(x - x0 * (1 - s)) / s**2
        mean = x + ds * v
        mean = mean + (-0.5 * eta**2 * score) * ds
        std = eta * torch.sqrt(s - s_next)
        kl_std = std

    sample = (mean + std * noise.to(torch.float32)).detach() if given is None else given
    if kind == "flow_grpo_cps":
        diff2 = (sample - mean) ** 2
        log_prob = -diff2.mean(dim=tuple(range(1, diff2.ndim)))
    else:
        log_prob = _gaussian_log_prob(sample, mean, std)
    return SDEStep(prev_sample=sample, log_prob=log_prob, mean=mean, std=std, kl_std=kl_std)


def kl_to_reference(mean: Tensor, mean_ref: Tensor, std) -> Tensor:
    """FlowGRPO's KL loss per sample, shape ``[B]``, float32:
    ``mean over non-batch dims of (mean - mean_ref)^2``, divided by ``2*std^2``.

    ``std`` is one value per sample (``[B]``, ``[B, 1, ...]``, 0-dim or a Python float); FlowGRPO
    averages first and then divides, and so do we. Pass ``SDEStep.kl_std`` to reproduce
    FlowGRPO's loss (its ``std_dev_t``, without the ``sqrt(s - s')`` factor), or ``SDEStep.std``
    for the exact KL between the two Gaussian transitions. Where ``std == 0`` (a deterministic
    step) the KL is returned as 0 rather than ``inf``/NaN; the gradient there is 0 as well.
    ``mean_ref`` should come from the frozen reference model and carry no gradient; it is not
    detached here.
    """
    if mean.shape != mean_ref.shape:
        raise ValueError(f"mean has shape {tuple(mean.shape)} but mean_ref has "
                         f"{tuple(mean_ref.shape)}; they must match")
    if mean.ndim < 2:
        raise ValueError(f"mean has shape {tuple(mean.shape)}; it needs a batch dimension "
                         "and at least one more ([B, ...])")
    m = mean.to(torch.float32)
    sq = ((m - mean_ref.to(torch.float32)) ** 2).mean(dim=tuple(range(1, m.ndim)))
    sd = _per_sample(std, m, "std", "mean").reshape(-1)
    positive = sd > 0
    safe = torch.where(positive, sd, torch.ones_like(sd))
    kl = sq / (2 * safe**2)
    return torch.where(positive, kl, torch.zeros_like(kl))
