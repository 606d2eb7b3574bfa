"""The inner optimizer's state between private steps: every change of a value is seen, nothing else is.

``snapshot_optimizer_state`` / ``put_back_optimizer_state_`` decide whether a private step may build on the state
an optimizer holds (its momentum or moments would carry a gradient without noise into every later step).  Hypothesis
draws torch optimizers, a few steps, and an edit (by hand, through ``.data`` or NumPy, a key added or removed, an
entry cleared, a tensor replaced by an equal copy, the step count moved); the check must report exactly the
parameters whose state values changed, and put back the snapshot's values to the bit.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from clipless.privacy.optimizer import put_back_optimizer_state_, snapshot_optimizer_state

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
}
EDITS = ["add", "data", "numpy", "tiny", "drop_key", "add_key", "clear_entry", "equal_copy", "same_values",
         "step_count"]


def _values(optimizer):
    return {id(p): {k: copy.deepcopy(v) for k, v in entry.items()} for p, entry in optimizer.state.items() if entry}


def _equal(a, b):
    if a.keys() != b.keys():
        return False
    for p in a:
        if a[p].keys() != b[p].keys():
            return False
        for k in a[p]:
            x, y = a[p][k], b[p][k]
            if isinstance(x, torch.Tensor):
                if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                        and torch.equal(x, y)):
                    return False
            elif x != y:
                return False
    return True


@settings(max_examples=150, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), steps=st.integers(1, 3), edit=st.sampled_from(EDITS),
       which=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_every_change_of_a_value_is_seen_and_put_back(name, steps, edit, which, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = OPTIMIZERS[name](model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
    saved = snapshot_optimizer_state(optimizer)
    released = _values(optimizer)
    p = list(model.parameters())[which]
    entry = optimizer.state[p]
    key = next(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    if edit == "add":
        entry[key].add_(1.0)
    elif edit == "data":
        entry[key].data = entry[key].data * 3.0 + 1.0
    elif edit == "numpy":
        entry[key].numpy().reshape(-1)[0] += 1.0
    elif edit == "tiny":  # one element moved by one unit in the last place
        flat = entry[key].view(-1)
        flat[0] = torch.nextafter(flat[0], flat[0] + 1.0)
    elif edit == "drop_key":
        del entry[key]
    elif edit == "add_key":
        entry["extra"] = torch.zeros(1)
    elif edit == "clear_entry":
        entry.clear()
    elif edit == "equal_copy":  # another tensor holding the same values: no change
        entry[key] = entry[key].clone()
    elif edit == "same_values":  # written with its own values, in place: no change
        entry[key].copy_(entry[key].clone())
    else:
        entry["step"] = entry["step"] + 1 if "step" in entry else torch.tensor(1.0)
    changed_values = not _equal(_values(optimizer), released)
    changed = put_back_optimizer_state_(optimizer, saved)
    assert (changed == [p]) if changed_values else (changed == [])
    assert _equal(_values(optimizer), released)  # put back to the bit, or left as it was
    assert put_back_optimizer_state_(optimizer, saved) == []
    optimizer.zero_grad()  # the optimizer steps on from the put-back state, which is not the snapshot's tensors
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    assert _equal({id(q): entry for q, entry in saved}, released)


def test_an_optimizer_state_snapshot_follows_its_parameters_through_a_deep_copy():
    """The snapshot names parameters by identity when compared: a deep copy of an optimizer with its snapshot (a
    deep copy of the private optimizer or of the pre-trainer) is unchanged, and an edit of the copy is seen, put
    back in the copy alone."""
    layer = nn.Linear(3, 2)
    inner = torch.optim.Adam(layer.parameters())
    layer(torch.randn(4, 3)).sum().backward()
    inner.step()
    twin, twin_saved = copy.deepcopy((inner, snapshot_optimizer_state(inner)))
    assert put_back_optimizer_state_(twin, twin_saved) == []
    twin.state[twin.param_groups[0]["params"][0]]["exp_avg"].add_(1.0)
    mine = inner.state[layer.weight]["exp_avg"].clone()
    assert put_back_optimizer_state_(twin, twin_saved) == [twin.param_groups[0]["params"][0]]
    assert torch.equal(twin.state[twin.param_groups[0]["params"][0]]["exp_avg"], mine)
    assert torch.equal(inner.state[layer.weight]["exp_avg"], mine)
