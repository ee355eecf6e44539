"""The workload generator: deterministic, RL-like bf16 change density, mixed dtypes, sizes."""

from __future__ import annotations

import pytest
import torch

from asyncsync.codec import int_view
from asyncsync.errors import ConfigError
from asyncsync.ops.workload import Workload, WorkloadConfig, config_for_elements, lr_for_density
from tests.conftest import same_bytes

SMALL = WorkloadConfig(layers=2, hidden=96, vocab=512)


def changed_fraction(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> float:
    """Fraction of elements whose bytes differ (only tensors of ``dtype`` when given)."""
    changed = total = 0
    for name, x in a.items():
        if dtype is not None and x.dtype != dtype:
            continue
        y = b[name]
        xi, yi = int_view(x.contiguous()).reshape(-1), int_view(y.contiguous()).reshape(-1)
        changed += int((xi != yi).sum())
        total += x.numel()
    return changed / total


def test_deterministic_for_a_seed() -> None:
    a, b, c = Workload(SMALL), Workload(SMALL), Workload(WorkloadConfig(2, 96, 512, seed=1))
    for wl in (a, b, c):
        wl.step()
        wl.step()
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    assert all(same_bytes(sa[k], sb[k]) for k in sa)
    assert not same_bytes(sa["lm_head.weight"], sc["lm_head.weight"])


def test_default_bf16_density_per_step_is_rl_like() -> None:
    wl = Workload(SMALL)
    prev = wl.state_dict()
    for _ in range(5):
        wl.step()
        cur = wl.state_dict()
        density = changed_fraction(prev, cur, torch.bfloat16)
        assert 0.005 <= density <= 0.06, density
        prev = cur


def test_state_dict_is_unchanged_without_a_step() -> None:
    wl = Workload(SMALL)
    wl.step()
    a, b = wl.state_dict(), wl.state_dict()
    assert changed_fraction(a, b) == 0.0
    a["lm_head.weight"].zero_()  # fresh tensors: the caller may keep or modify them
    assert not same_bytes(a["lm_head.weight"], wl.state_dict()["lm_head.weight"])


def test_mixed_dtypes_and_names() -> None:
    wl = Workload(SMALL)
    sd = wl.state_dict()
    dtypes = {t.dtype for t in sd.values()}
    assert {torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn} <= dtypes
    assert any(t.numel() == 0 for t in sd.values())
    step = sd["model.global_step"]
    assert step.dim() == 0 and step.dtype == torch.int64 and int(step) == 0
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in sd
    assert sd["model.embed_tokens.weight"].shape == (512, 96)
    wl.step()
    assert int(wl.state_dict()["model.global_step"]) == 1


def test_without_extras_everything_is_publish_dtype() -> None:
    wl = Workload(WorkloadConfig(2, 64, 100, extras=False, publish_dtype=torch.float16))
    assert {t.dtype for t in wl.state_dict().values()} == {torch.float16}


@pytest.mark.parametrize("n", [200_000, 2_000_000])
def test_for_elements_is_close(n: int) -> None:
    cfg = config_for_elements(n)
    assert abs(cfg.elements() - n) / n < 0.05
    assert cfg.layers >= 1 and cfg.hidden % 32 == 0


@pytest.mark.parametrize("target", [0.005, 0.03, 0.10])
def test_with_density_hits_the_target(target: float) -> None:
    wl = Workload.for_elements(300_000, density=target, seed=7)
    prev = wl.state_dict()
    wl.step()
    got = changed_fraction(prev, wl.state_dict())
    assert target * 0.75 <= got <= target * 1.25, (target, got)


def test_lr_is_monotonic_in_density() -> None:
    lrs = [lr_for_density(d) for d in (0.001, 0.005, 0.01, 0.05, 0.2, 0.6)]
    assert lrs == sorted(lrs)
    assert lr_for_density(0.01, init_std=0.04) == pytest.approx(2 * lr_for_density(0.01))


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="layers"):
        WorkloadConfig(layers=0, hidden=64, vocab=10)
    with pytest.raises(ConfigError, match="lr"):
        WorkloadConfig(layers=1, hidden=64, vocab=10, lr=float("nan"))
    with pytest.raises(ConfigError, match="publish_dtype"):
        WorkloadConfig(layers=1, hidden=64, vocab=10, publish_dtype=torch.int8)
    with pytest.raises(ConfigError, match="density"):
        SMALL.with_density(1.5)
    with pytest.raises(ConfigError, match="elements"):
        Workload.for_elements(10)
