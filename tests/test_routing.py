"""Routing a delta through ``load_weights`` (receiver.plugins.routing): what is a pure copy and
what is not, with loaders shaped like SGLang's (narrow + ``copy_``, ``fill_`` of one-element
parameters, padding rows, tied copies) and loaders that must be refused (conversion,
broadcast, arithmetic, ``.item()``, other in-place ops, rebinding, overlapping writes)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

from asyncsync.codec import int_view
from receiver.plugins.routing import ModelParams, apply_xor, compare, probe_tensor, route
from receiver.plugins.scatter import apply_plan, make_plan

Loader = Callable[[nn.Module, str, torch.Tensor], None]


class Model(nn.Module):
    """Two parameters and a buffer; ``loader`` decides how an HF tensor lands."""

    def __init__(self, loader: Loader, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(6, 4, dtype=dtype), requires_grad=False)
        self.v = nn.Parameter(torch.zeros(6, 4, dtype=dtype), requires_grad=False)
        self.register_buffer("b", torch.zeros(3, dtype=dtype))
        self.one = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
        self.loader = loader

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.loader(self, name, t)


def xor_of(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return (int_view(old) ^ int_view(new)).view(old.dtype).view(old.shape)


def full_then_xor(loader: Loader, old: torch.Tensor, new: torch.Tensor) -> tuple[Model, Model]:
    """(model loaded with ``old`` then XOR-routed to ``new``, model loaded with ``new``)."""
    m, ref = Model(loader, old.dtype), Model(loader, old.dtype)
    m.load_weights([("x", old)])
    ref.load_weights([("x", new)])
    r = route(m.load_weights, "x", xor_of(old, new), ModelParams(m))
    assert r.ok, r.problem
    apply_xor(r)
    return m, ref


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(int_view(sa[k]), int_view(sb[k])) for k in sa)


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------- pure copies


def sliced(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.narrow(0, 2, 4).copy_(t.narrow(0, 1, 4))  # a rank's rows into a fused slot


def padded(m: nn.Module, name: str, t: torch.Tensor) -> None:  # VocabParallelEmbedding
    m.w[: t.shape[0]].data.copy_(t)
    m.w[t.shape[0] :].data.fill_(0)


def transposed(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t.t().contiguous())


def concatenated(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(torch.cat([t, torch.zeros(2, 4, dtype=t.dtype)]))


def tied_copy(m: nn.Module, name: str, t: torch.Tensor) -> None:  # v2 loader's tied lm_head
    m.w.data.copy_(t)
    m.v.data.copy_(m.w.data)


@pytest.mark.parametrize(
    ("loader", "shape"),
    [(sliced, (6, 4)), (padded, (4, 4)), (transposed, (4, 6)), (concatenated, (4, 4)),
     (tied_copy, (6, 4))],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_copying_loader_takes_the_xor_bit_exact(
    loader: Loader, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    old = rand(*shape, dtype=dtype)
    new = old.clone()
    new.view(-1)[::3] = rand(new.numel() // 3 + 1, dtype=dtype, seed=1)[: new.view(-1)[::3].numel()]
    new.view(torch.int16 if dtype != torch.float32 else torch.int32).view(-1)[1] ^= 1  # NaN-safe
    m, ref = full_then_xor(loader, old, new)
    assert same(m, ref)
    r = route(m.load_weights, "x", new.clone(), ModelParams(m))
    assert compare(r) is None  # the audit agrees
    m.w.data.view(-1)[9] += 1  # and sees one element that differs (row 2: every loader writes it)
    assert compare(route(m.load_weights, "x", new.clone(), ModelParams(m))) is not None


def test_a_probe_predicts_the_route() -> None:
    old = rand(6, 4)
    m = Model(tied_copy)
    m.load_weights([("x", old)])
    params = ModelParams(m)
    probe = route(m.load_weights, "x", probe_tensor((6, 4), torch.float32), params)
    real = route(m.load_weights, "x", xor_of(old, rand(6, 4, seed=3)), params)
    assert probe.footprint() == real.footprint()
    assert [w.kind for w in real.writes] == ["xor", "copy"]
    assert torch.equal(m.w, old)  # routing wrote nothing


def test_a_parameter_copied_onto_itself_is_no_write() -> None:
    def onto_itself(m: nn.Module, name: str, t: torch.Tensor) -> None:
        m.w.data.copy_(t)
        m.w.data.copy_(m.w.data)

    m = Model(onto_itself)
    r = route(m.load_weights, "x", rand(6, 4), ModelParams(m))
    assert r.ok and [w.kind for w in r.writes] == ["xor"]


def test_a_skipped_tensor_writes_nothing() -> None:
    m = Model(lambda m, n, t: None)  # e.g. a tied lm_head.weight or rotary inv_freq
    r = route(m.load_weights, "x", rand(6, 4), ModelParams(m))
    assert r.ok and r.writes == []


# --------------------------------------------------------------------------- refused


def converting(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t)  # bf16 delta into a float32 parameter: copy_ converts


def broadcasting(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t[:1])


def scaling(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t * 0.5)


def float_then_back(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t.float().to(m.w.dtype))


def one_element(m: nn.Module, name: str, t: torch.Tensor) -> None:  # default_weight_loader
    m.one.data.fill_(t.item())


def adding(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.add_(t)


def rebinding(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data = t.clone()


def twice(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t)
    m.w.data.narrow(0, 0, 2).copy_(t.narrow(0, 0, 2))


def fill_after_copy(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t)
    m.w.data[0].fill_(1.0)


def from_a_param_sum(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(m.v.data + t)


def changes_the_delta(m: nn.Module, name: str, t: torch.Tensor) -> None:
    t.mul_(2)
    m.w.data.copy_(t)


def custom_op(m: nn.Module, name: str, t: torch.Tensor) -> None:
    torch.ops.aten.copy_.default(m.w.data, t)


def index_put(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data[[0, 1]] = t[[0, 1]]


def into_a_buffer(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.b.copy_(t.view(-1)[:3].double().float())


@pytest.mark.parametrize(
    ("loader", "tensor", "why"),
    [
        (converting, rand(6, 4, dtype=torch.bfloat16), "converts"),
        (broadcasting, rand(6, 4), "broadcasts"),
        (scaling, rand(6, 4), "computed from the delta"),
        (float_then_back, rand(6, 4).to(torch.float32), None),
        (one_element, rand(1), "left torch"),
        (adding, rand(6, 4), "not a copy"),
        (rebinding, rand(6, 4), "not a copy"),
        (twice, rand(6, 4), "written twice"),
        (fill_after_copy, rand(6, 4), "written twice"),
        (from_a_param_sum, rand(6, 4), "computed from the delta"),
        (changes_the_delta, rand(6, 4), "in place"),
        (custom_op, rand(6, 4), "not a copy"),
        (index_put, rand(6, 4), "not a copy"),
    ],
)
def test_what_is_no_copy_is_refused_and_nothing_written(
    loader: Loader, tensor: torch.Tensor, why: str | None
) -> None:
    m = Model(loader)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    r = route(m.load_weights, "x", tensor, ModelParams(m))
    if why is None:  # float32 .float() is the tensor itself: a pure copy after all
        assert r.ok
        return
    assert not r.ok and why in (r.problem or ""), r.problem
    assert r.writes == []
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError):
        apply_xor(r)


def test_a_converted_buffer_write_is_refused() -> None:
    m = Model(into_a_buffer)
    r = route(m.load_weights, "x", rand(6, 4), ModelParams(m))
    assert not r.ok and "computed from the delta" in (r.problem or "")


def test_the_guard_vetoes_a_transformed_parameter() -> None:
    m = Model(sliced)
    packed = lambda p, mod: "packed after loading" if p == "w" else None  # noqa: E731
    r = route(m.load_weights, "x", rand(6, 4), ModelParams(m), guard=packed)
    assert not r.ok and "packed after loading" in (r.problem or "")


def test_a_loader_that_raises_is_a_problem() -> None:
    def boom(m: nn.Module, name: str, t: torch.Tensor) -> None:
        raise KeyError("no such parameter")

    r = route(Model(boom).load_weights, "x", rand(6, 4), ModelParams(Model(boom)))
    assert not r.ok and "KeyError" in (r.problem or "")


def test_rebinding_outside_the_mode_marks_the_model_altered() -> None:
    """A loader that swaps a parameter object (not through torch) changes the model for real:
    the route says so, only a full reload is safe afterwards."""

    def swap(m: nn.Module, name: str, t: torch.Tensor) -> None:
        m._parameters["w"] = nn.Parameter(torch.ones(6, 4), requires_grad=False)

    m = Model(swap)
    r = route(m.load_weights, "x", rand(6, 4), ModelParams(m))
    assert r.altered and not r.ok


def test_route_is_thread_local(tmp_path: Any) -> None:
    """Routing in one thread leaves torch calls in another untouched (the audit runs beside
    the engine's own forward passes)."""
    import threading

    m = Model(sliced)
    seen: list[bool] = []
    started, release = threading.Event(), threading.Event()

    def slow(mm: nn.Module, name: str, t: torch.Tensor) -> None:
        started.set()
        release.wait(5)
        sliced(mm, name, t)

    m.loader = slow
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(route(m.load_weights, "x", rand(6, 4),
                                                          ModelParams(m))))  # fmt: skip
    th.start()
    started.wait(5)
    m.v.data.add_(1)  # a real write from another thread while the mode is active there
    seen.append(bool((m.v == 1).all()))
    release.set()
    th.join(5)
    assert seen == [True] and out[0].ok


# --------------------------------------------------------------------------- sparse plans


def selected_rows(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.narrow(0, 1, 4).narrow(1, 1, 2).copy_(t.select(0, 2).view(4, 2))


def strided_cols(m: nn.Module, name: str, t: torch.Tensor) -> None:
    m.w.data.copy_(t.t()[:, ::2])  # every other column, transposed: gaps between elements


@pytest.mark.parametrize(
    ("loader", "shape", "plannable"),
    [(sliced, (6, 4), True), (padded, (4, 4), True), (tied_copy, (6, 4), True),
     (selected_rows, (3, 8), True), (strided_cols, (8, 6), True),
     (transposed, (4, 6), False), (concatenated, (4, 4), False)],
)  # fmt: skip
def test_a_sparse_plan_equals_the_dense_route(
    loader: Loader, shape: tuple[int, ...], plannable: bool
) -> None:
    """A plan maps each changed position through the loader's views: the same bytes as the
    routed dense XOR, touching only the changed elements; applied twice it undoes itself.
    A loader that copies (``contiguous`` of a transpose, ``cat``) has no plan."""
    g = torch.Generator().manual_seed(3)
    old = rand(*shape, seed=4)
    flat_new = int_view(old).clone()
    pos = torch.randperm(old.numel(), generator=g)[: old.numel() // 3].sort().values
    flat_new[pos] ^= torch.randint(1, 2**20, (pos.numel(),), generator=g, dtype=torch.int32)
    new = flat_new.view(old.dtype).view(old.shape)
    sparse, dense = Model(loader), Model(loader)
    for m in (sparse, dense):
        m.load_weights([("x", old)])
    routed = torch.empty(shape)
    plan = make_plan(route(sparse.load_weights, "x", routed, ModelParams(sparse)), routed)
    assert (plan is not None) == plannable
    r = route(dense.load_weights, "x", xor_of(old, new), ModelParams(dense))
    apply_xor(r)
    if plan is None:
        return
    before = {k: v.clone() for k, v in sparse.state_dict().items()}
    values = (int_view(old) ^ int_view(new))[pos]
    apply_plan(plan, pos, values)
    assert same(sparse, dense)
    apply_plan(plan, pos, values)  # the undo
    assert all(torch.equal(v, before[k]) for k, v in sparse.state_dict().items())


def test_a_broadcast_or_reinterpreting_view_has_no_plan() -> None:
    def broadcast(m: nn.Module, name: str, t: torch.Tensor) -> None:
        m.w.data.copy_(t.expand(6, 4))

    m = Model(broadcast)
    routed = torch.empty(1, 4)
    r = route(m.load_weights, "x", routed, ModelParams(m))
    assert r.ok and make_plan(r, routed) is None

    def as_ints(m: nn.Module, name: str, t: torch.Tensor) -> None:
        m.b.copy_(t.view(torch.int32).view(-1)[:3].view(torch.float32))

    m = Model(as_ints)
    routed = torch.empty(6, 4)
    r = route(m.load_weights, "x", routed, ModelParams(m))
    plan = make_plan(r, routed)
    assert plan is not None and len(plan.steps) == 1  # same width: the same bytes, planned
