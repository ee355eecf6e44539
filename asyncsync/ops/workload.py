"""A realistic, seeded RL-training workload for demos, benchmarks and tests (pure: no I/O).

Why: the cost of a sparse delta depends on *which* bits change, not just how many. Real RL
fine-tuning keeps fp32 master weights, updates them with Adam, and publishes them as bf16. Most
Adam updates are smaller than one bf16 ulp, so each published step flips only about 1-5 % of
the bf16 elements, scattered and mostly in the low mantissa bits. Random byte flips model that
badly (they are incompressible); this generator reproduces it::

    wl = Workload(WorkloadConfig(layers=4, hidden=256, vocab=4096, seed=0))
    sd0 = wl.state_dict()            # bf16 publish view (+ a few other dtypes)
    wl.step()                        # one Adam step on the fp32 master
    sd1 = wl.state_dict()            # ~2 % of the bf16 elements differ from sd0

The model is transformer shaped (embed, per layer q/k/v/o, MLP gate/up/down, norms, lm_head,
Llama-style names). The optimizer is warm: the moments start at their steady-state
distribution, as in RL that continues from a trained model, so density is flat from the first
step instead of spiking while bias correction settles.

The gradient is white noise per element. Adam normalises its scale away, so the bf16 change
density is set by ``lr`` relative to the weights' magnitude (``init_std``). Measured steady
densities of the publish view, as the publisher counts them (``init_std=0.02``, 0.2M-20M
elements, any seed; steady within about 1 % of the value from step 1 on;
:data:`DENSITY_CALIBRATION` holds the table that :func:`lr_for_density` interpolates):

=========  =========  ===========================================
lr         density    note
=========  =========  ===========================================
4.8e-7     0.5 %      ``with_density(0.005)``
1.1e-6     1.0 %      ``with_density(0.01)``
3.0e-6     2.4 %      the default
4.0e-6     3.0 %      ``with_density(0.03)``
1.8e-5     10 %       ``with_density(0.10)``
=========  =========  ===========================================

With ``extras=True`` the publish view also carries tensors of other dtypes, so a pipeline
sees mixed dtypes: an int64 0-d step counter, a bool mask derived from the weights, the final
norm in fp32 (every element changes every step), an fp8 e4m3 copy of one projection (changes
rarely), and an empty tensor.

Generation works on one flat fp32 buffer with whole-tensor torch ops: about 20 bytes of memory
per element (master, two moments, gradient, scratch); on 2 CPU cores a 50M-element step takes
about 0.4 s and its publish view about 0.1 s.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.errors import ConfigError

__all__ = [
    "DENSITY_CALIBRATION",
    "Workload",
    "WorkloadConfig",
    "config_for_elements",
    "lr_for_density",
]

logger = logging.getLogger(__name__)

#: (lr, measured density of the publish view) with ``init_std=0.02``, ascending: the mean over
#: steps 1-10 of ``Workload.for_elements(4_000_000, lr=lr, seed=1)``.
DENSITY_CALIBRATION: tuple[tuple[float, float], ...] = (
    (1.0e-7, 0.00124),
    (2.0e-7, 0.00230),
    (5.0e-7, 0.00515),
    (1.0e-6, 0.00938),
    (2.0e-6, 0.01689),
    (3.0e-6, 0.02373),
    (5.0e-6, 0.03617),
    (1.0e-5, 0.06320),
    (2.0e-5, 0.10825),
    (4.0e-5, 0.18024),
    (8.0e-5, 0.28845),
    (1.6e-4, 0.43537),
)

_FP8_SCALE_TARGET = 240.0  # per-tensor static scale maps the fp8 copy's max to this magnitude


def lr_for_density(density: float, *, init_std: float = 0.02) -> float:
    """The learning rate at which a step changes about ``density`` (0-1) of the bf16 elements.

    Log-log interpolation in :data:`DENSITY_CALIBRATION` (extrapolated past its ends); the
    result scales with ``init_std`` because only ``lr / init_std`` matters.
    """
    if not 0.0 < density < 1.0 or not math.isfinite(density):
        raise ConfigError(f"density must be in (0, 1), e.g. 0.02 for 2 %, got {density!r}")
    table = DENSITY_CALIBRATION
    ds = [d for _, d in table]
    i = min(max(bisect.bisect_left(ds, density), 1), len(table) - 1)
    (lr0, d0), (lr1, d1) = table[i - 1], table[i]
    slope = (math.log(lr1) - math.log(lr0)) / (math.log(d1) - math.log(d0))
    lr = math.exp(math.log(lr0) + slope * (math.log(density) - math.log(d0)))
    return lr * init_std / 0.02


@dataclass(frozen=True)
class WorkloadConfig:
    """Shapes and optimizer settings of a :class:`Workload`.

    ``intermediate`` defaults to about 8/3 of ``hidden`` (Llama's MLP ratio), rounded to 16.
    ``lr`` sets the per-step bf16 change density (see the module docstring, or use
    :meth:`with_density`).
    """

    layers: int
    hidden: int
    vocab: int
    intermediate: int | None = None
    lr: float = 3.0e-6
    seed: int = 0
    publish_dtype: torch.dtype = torch.bfloat16
    extras: bool = True
    init_std: float = 0.02
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"WorkloadConfig.{name} must be a positive int, got {v!r}")
        if self.intermediate is not None and self.intermediate < 1:
            raise ConfigError(f"WorkloadConfig.intermediate must be >= 1, got {self.intermediate}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError(f"WorkloadConfig.lr must be a finite number >= 0, got {self.lr!r}")
        if not (self.init_std > 0 and math.isfinite(self.init_std)):
            raise ConfigError(f"WorkloadConfig.init_std must be > 0, got {self.init_std!r}")
        if not (0 <= self.beta1 < 1 and 0 < self.beta2 < 1):
            raise ConfigError("WorkloadConfig betas must satisfy 0 <= beta1 < 1, 0 < beta2 < 1")
        if not self.publish_dtype.is_floating_point:
            raise ConfigError(
                f"publish_dtype must be a floating dtype (e.g. torch.bfloat16), "
                f"got {self.publish_dtype}"
            )

    @property
    def mlp(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return max(16, round(self.hidden * 8 / 3 / 16) * 16)

    def with_density(self, density: float) -> WorkloadConfig:
        """This config with the ``lr`` that gives about ``density`` (0-1) changed bf16 elements."""
        return dataclasses.replace(self, lr=lr_for_density(density, init_std=self.init_std))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every fp32 master parameter, in state-dict order."""
        h, f, v = self.hidden, self.mlp, self.vocab
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}"
            shapes[f"{p}.input_layernorm.weight"] = (h,)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[f"{p}.self_attn.{proj}.weight"] = (h, h)
            shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
            shapes[f"{p}.mlp.gate_proj.weight"] = (f, h)
            shapes[f"{p}.mlp.up_proj.weight"] = (f, h)
            shapes[f"{p}.mlp.down_proj.weight"] = (h, f)
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (v, h)
        return shapes

    def elements(self) -> int:
        """Elements of the master parameters (the publish view adds a few extras)."""
        return sum(math.prod(s) for s in self.param_shapes().values())


class Workload:
    """Simulated RL training: fp32 master weights, warm Adam steps, a low-precision publish view.

    Deterministic for a given config (seed included): the same sequence of ``step()`` calls
    yields bit-identical state dicts on any machine with the same torch version.
    """

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.steps = 0
        self._gen = torch.Generator().manual_seed(cfg.seed)
        shapes = cfg.param_shapes()
        self.numel = sum(math.prod(s) for s in shapes.values())
        self._master = torch.empty(self.numel, dtype=torch.float32)
        self._params: dict[str, torch.Tensor] = {}
        off = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            view = self._master[off : off + n].view(shape)
            off += n
            if name.endswith("norm.weight"):
                # trained norms sit near 1 but not on it
                torch.randn(shape, generator=self._gen, out=view)
                view.mul_(0.05).add_(1.0)
            else:
                torch.randn(shape, generator=self._gen, out=view)
                view.mul_(cfg.init_std)
            self._params[name] = view
        # Warm optimizer: moments at the steady state of Adam fed unit white noise, so the
        # update size (and the change density) is the same from the first step on.
        self._m = torch.randn(self.numel, generator=self._gen)
        self._m.mul_(math.sqrt((1 - cfg.beta1) / (1 + cfg.beta1)))
        self._v = torch.ones(self.numel, dtype=torch.float32)
        self._grad = torch.empty(self.numel, dtype=torch.float32)
        self._denom = torch.empty(self.numel, dtype=torch.float32)
        last = f"model.layers.{cfg.layers - 1}.mlp.down_proj.weight"
        self._mask_source = last
        self._fp8_source = "model.layers.0.self_attn.o_proj.weight"
        amax = float(self._params[self._fp8_source].abs().max())
        self._fp8_scale = _FP8_SCALE_TARGET / amax if amax > 0 else 1.0
        self._mask_threshold = 0.1 * cfg.init_std
        logger.debug("workload: %d master elements, lr=%g", self.numel, cfg.lr)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def for_elements(n: int, *, density: float | None = None, **kw: Any) -> Workload:
        """A workload of about ``n`` master elements (within a few %, for n >= ~100k).

        Shapes follow a transformer's proportions: about 3/4 of the elements in the layers,
        the rest in embed + lm_head. ``density`` (0-1) picks the lr for that change density;
        other keyword arguments go to :class:`WorkloadConfig` (``seed``, ``lr``, ``extras``...).
        """
        return Workload(config_for_elements(n, density=density, **kw))

    # ------------------------------------------------------------------ training
    def step(self) -> None:
        """One Adam update of the fp32 master with a fresh white-noise gradient."""
        c = self.cfg
        g = self._grad
        torch.randn(self.numel, generator=self._gen, out=g)
        self._m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
        self._v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        torch.sqrt(self._v, out=self._denom)
        self._denom.add_(c.eps)
        self._master.addcdiv_(self._m, self._denom, value=-c.lr)
        self.steps += 1

    # ------------------------------------------------------------------ views
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """Clones of the fp32 master parameters (what an optimizer checkpoint would hold)."""
        return {k: v.clone() for k, v in self._params.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The publish view: fresh tensors (safe to hand to a publisher and keep stepping).

        Parameters in ``publish_dtype`` (the final norm in fp32 when ``extras``), plus with
        ``extras`` an int64 step counter, a bool mask, an fp8 e4m3 tensor and an empty tensor.
        """
        c = self.cfg
        out: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            if c.extras and name == "model.norm.weight":
                out[name] = p.clone()
            else:
                out[name] = p.to(c.publish_dtype, copy=True)
        if c.extras:
            out["model.global_step"] = torch.tensor(self.steps, dtype=torch.int64)
            src = self._params[self._mask_source]
            out[self._mask_source.replace(".weight", ".prune_mask")] = (
                src.abs() < self._mask_threshold
            )
            fp8 = (self._params[self._fp8_source] * self._fp8_scale).to(torch.float8_e4m3fn)
            out[self._fp8_source.replace(".weight", ".weight_fp8")] = fp8
            out["model.unused_bias"] = torch.empty(0, dtype=c.publish_dtype)
        return out

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"<Workload layers={c.layers} hidden={c.hidden} vocab={c.vocab} "
            f"elements={self.numel} lr={c.lr:g} step={self.steps}>"
        )


def config_for_elements(n: int, *, density: float | None = None, **kw: Any) -> WorkloadConfig:
    """The :class:`WorkloadConfig` behind :meth:`Workload.for_elements`."""
    if not isinstance(n, int) or n < 1000:
        raise ConfigError(f"a workload needs at least 1000 elements, got {n!r}")
    # body = layers * ~12 h^2 with layers ~ h/32  =>  0.75 n ~ 0.375 h^3
    hidden = max(32, round((2 * n) ** (1 / 3) / 32) * 32)
    mlp = WorkloadConfig(layers=1, hidden=hidden, vocab=1).mlp
    per_layer = 4 * hidden * hidden + 3 * hidden * mlp
    layers = max(1, round(0.75 * n / per_layer))
    rest = n - layers * (per_layer + 2 * hidden) - hidden
    vocab = max(16, round(rest / (2 * hidden)))
    cfg = WorkloadConfig(layers=layers, hidden=hidden, vocab=vocab, **kw)
    if density is not None:
        cfg = cfg.with_density(density)
    return cfg
