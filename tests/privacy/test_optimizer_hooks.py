"""What the inner optimizer runs and keeps beyond its per-parameter ``state``: hooks and tensors held elsewhere.

A hook of the optimizer inside the private step (its own, a wrapped optimizer's, or torch's global step hooks) runs
on the noisy gradient but may read a gradient the loop saved before the noise, and write it into the weights; an
optimizer that keeps its momentum in a plain attribute (or wraps another one, as Lookahead does) carries whatever the
loop writes there into every later step.  Each attack below released the raw gradient before these checks.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from helpers import honest_steps, next_batch_backward, small_private_run
from clipless.privacy.certified import BoundError

OPTIM = importlib.import_module("torch.optim.optimizer")  # torch.optim does not name it


class AttributeMomentum(torch.optim.Optimizer):
    """Heavy-ball momentum kept in ``self.buffers[p]``, not in ``self.state``."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.buffers = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.buffers.setdefault(p, torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al., 2019) around a base optimizer: slow weights in a list, the base's own state."""

    def __init__(self, params, lr=0.1, k=2, alpha=0.5):  # pylint: disable=super-init-not-called
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        self.param_groups, self.defaults, self.state = self.optimizer.param_groups, self.optimizer.defaults, {}
        self.slow = [p.detach().clone() for group in self.param_groups for p in group["params"]]
        self.k, self.alpha, self.count = k, alpha, 0

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        self.optimizer.step()
        self.count += 1
        if self.count % self.k == 0:
            fast = [p for group in self.param_groups for p in group["params"]]
            for slow, p in zip(self.slow, fast):
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)


REGISTRIES = ["register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
              "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
              "register_load_state_dict_post_hook"]
GLOBAL = ["register_optimizer_step_pre_hook", "register_optimizer_step_post_hook"]


def _noop(*args):
    return None


@pytest.mark.parametrize("registry", REGISTRIES + GLOBAL)
def test_an_inner_optimizer_with_hooks_is_refused_at_make_private(registry):
    handles = []

    def register(optimizer):
        owner = OPTIM if registry in GLOBAL else optimizer
        handles.append(getattr(owner, registry)(_noop))
    try:
        with pytest.raises(ValueError, match=rf"has hooks \(.*{registry} \(_noop\)\).*handle.remove"):
            small_private_run(before_private=register)
    finally:
        for handle in handles:
            handle.remove()
    small_private_run()  # removed, the same optimizer is accepted: the step guard's own global hook is no user's


@pytest.mark.parametrize("registry", ["register_step_pre_hook", "register_step_post_hook",
                                      "register_optimizer_step_pre_hook"])
def test_a_hook_that_releases_the_raw_gradient_is_refused_before_it_runs(registry):
    """The hook puts back the gradient the loop saved before the noise: the step must never run it."""
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader, 2)
    saved, ran = {}, []

    def raw_gradient(*args):
        ran.append(True)
        for p, g in saved.items():
            if p.grad is not None:
                p.grad.copy_(g)
            elif registry.endswith("post_hook"):  # after the step: move the weights by the raw gradient
                p.data.add_(g, alpha=-0.1)

    owner = OPTIM if registry in GLOBAL else opt.original_optimizer
    weights = [p.detach().clone() for p in model.parameters()]
    steps = engine.accountant.steps
    opt.zero_grad()
    saved.update(next_batch_backward(model, loss, loader))
    handle = getattr(owner, registry)(raw_gradient)  # between the backward and the step
    try:
        with pytest.raises(BoundError, match="has hooks"):
            opt.step()
        with pytest.raises(BoundError, match="has hooks"):  # nor may a checkpoint run it
            opt.state_dict()
        assert not ran and engine.accountant.steps == steps
        assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
        opt.zero_grad()
        next_batch_backward(model, loss, loader)  # a forward with the hook in place: its step is refused as well
        with pytest.raises(BoundError, match="the optimizer inside the private step has hooks"):
            opt.step()
        assert not ran and engine.accountant.steps == steps
    finally:
        handle.remove()
    honest_steps(model, opt, loss, loader, 1)  # the hook removed, the run goes on
    assert not ran and engine.accountant.steps == steps + 1


def test_a_state_dict_hook_added_later_never_runs():
    model, opt, loss, engine, loader = small_private_run()
    honest_steps(model, opt, loss, loader, 1)
    ran = []
    handle = opt.original_optimizer.register_state_dict_post_hook(lambda o, state: ran.append(state))
    with pytest.raises(BoundError, match="register_state_dict_post_hook"):
        opt.state_dict()
    assert not ran
    handle.remove()
    assert "optimizer" in opt.state_dict()


@pytest.mark.parametrize("optimizer_cls, where", [(AttributeMomentum, "buffers"), (Lookahead, "slow"),
                                                  (Lookahead, "wrapped")])
def test_state_kept_outside_the_optimizer_state_is_checked_and_put_back(optimizer_cls, where):
    model, opt, loss, engine, loader = small_private_run(optimizer_cls)
    honest_steps(model, opt, loss, loader, 3)  # honest steps are accepted, Lookahead's slow updates included
    inner = opt.original_optimizer
    held = {"buffers": lambda: list(inner.buffers.values()), "slow": lambda: inner.slow,
            "wrapped": lambda: [s["momentum_buffer"] for s in inner.optimizer.state.values()]}[where]
    released = [t.clone() for t in held()]
    weights = [p.detach().clone() for p in model.parameters()]
    steps = engine.accountant.steps
    opt.zero_grad()
    raw = next_batch_backward(model, loss, loader)
    for t, g in zip(held(), raw.values()):  # the raw gradient written into what the next step applies
        t.add_(g, alpha=100.0)
    name = {"buffers": r"buffers\[0.weight\]", "slow": r"slow\[0\]", "wrapped": r"<wrapped SGD 1>\.state\[0.weight\]"}
    with pytest.raises(BoundError, match=rf"keeps outside its state \({name[where]}.*put back"):
        opt.step()
    assert engine.accountant.steps == steps
    assert all(torch.equal(a, t) for a, t in zip(released, held()))
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    honest_steps(model, opt, loss, loader, 2)  # put back, the run goes on
    assert engine.accountant.steps == steps + 2


def test_held_tensors_name_parameters_and_leave_the_weights_out():
    model, opt, loss, engine, loader = small_private_run(AttributeMomentum)
    opt.original_optimizer.weights = list(model.parameters())  # the weights themselves: the released state's
    honest_steps(model, opt, loss, loader, 2)
    held = opt._held()
    assert sorted(held) == ["buffers[0.weight]", "buffers[2.weight]"]


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradients its step is given (an optimizer class of one's own, fixed at make_private)."""

    given = []

    def step(self, closure=None):
        RecordingSGD.given.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def test_a_release_hook_sees_copies_of_the_released_gradients_and_cannot_change_the_step():
    """The way to observe a release: the gradients the inner optimizer is given, as copies by parameter name."""
    model, opt, loss, engine, loader = small_private_run(RecordingSGD)
    RecordingSGD.given.clear()
    seen = []

    def vandal(grads):  # edits its copies: the step must not see that
        seen.append({name: g.clone() for name, g in grads.items()})
        for g in grads.values():
            g.mul_(1e6)

    handle = opt.register_release_hook(vandal)
    honest_steps(model, opt, loss, loader, 2)
    assert len(seen) == 2 and all(sorted(s) == ["0.weight", "2.weight"] for s in seen)
    names = [name for name, _ in model.named_parameters()]
    for mine, given in zip(seen, RecordingSGD.given):
        assert all(torch.equal(mine[name], g) for name, g in zip(names, given))
    handle.remove()
    honest_steps(model, opt, loss, loader, 1)
    assert len(seen) == 2 and len(RecordingSGD.given) == 3 and engine.accountant.steps == 3
    with pytest.raises(TypeError, match="callable"):
        opt.register_release_hook("print")


@pytest.mark.parametrize("where", ["instance", "class"])
def test_an_inner_step_replaced_after_make_private_is_refused_before_it_runs(where):
    """``inner.step = f`` (or on its class) after make_private would run ``f`` inside the private step."""
    model, opt, loss, engine, loader = small_private_run(RecordingSGD)
    honest_steps(model, opt, loss, loader, 1)
    inner, ran = opt.original_optimizer, []

    def replaced(*args, **kwargs):
        ran.append(True)

    opt.zero_grad()
    next_batch_backward(model, loss, loader)
    if where == "instance":
        inner.step = replaced
    else:
        RecordingSGD.step, original = replaced, RecordingSGD.step
    try:
        with pytest.raises(BoundError, match="step function .* replaced after make_private"):
            opt.step()
        assert not ran and engine.accountant.steps == 1
    finally:
        if where == "instance":
            del inner.step
        else:
            RecordingSGD.step = original
    honest_steps(model, opt, loss, loader, 1)
    assert engine.accountant.steps == 2


def test_a_scheduler_made_on_the_inner_optimizer_before_make_private_still_steps():
    """torch's schedulers wrap the optimizer's step on the instance: one made before make_private is its setting."""
    schedules = []
    model, opt, loss, engine, loader = small_private_run(
        before_private=lambda inner: schedules.append(torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)))
    for _ in range(2):
        honest_steps(model, opt, loss, loader, 1)
        schedules[0].step()
    assert engine.accountant.steps == 2 and opt.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
