"""Did two contenders train to the same result? A speed-up of a wrong computation is never reported."""

import torch


def local(t):
    """A DTensor's local shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _flat_state(state):
    """name -> tensor or value of a model + optimizer state."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, st in state["optimizer"]["state"].items():
        out.update((f"optimizer.state[{pid}].{k}", v) for k, v in st.items())
    return out


def compare_states(a, b):
    """(equal bit for bit, largest absolute difference in the model's weights and buffers) of two
    ``{"model": state_dict, "optimizer": state_dict}``; tensors are compared on ``a``'s device.
    Entries are matched by name: an optimizer may create its per-parameter state in any order."""
    a, b = _flat_state(a), _flat_state(b)
    if a.keys() != b.keys():
        raise ValueError("the model or optimizer state has different entries")
    equal, worst = True, 0.0
    for key, va in a.items():
        vb = b[key]
        if not isinstance(va, torch.Tensor):
            equal = equal and va == vb
            continue
        vb = vb.to(va.device)
        equal = equal and torch.equal(va, vb)
        if key.startswith("model.") and va.is_floating_point() and va.numel():
            worst = max(worst, (va.double() - vb.double()).abs().max().item())
    return equal, worst


def assert_trained_alike(name, ref_params, params, ref_opt, opt, ref_name="unpatched"):
    """``name`` ended with exactly the parameters (local shards, for DTensors) and optimizer state
    of ``ref_name``, bit for bit."""
    for i, (a, b) in enumerate(zip(ref_params, params)):
        a, b = local(a).detach(), local(b).detach()
        assert torch.equal(a, b), f"{name}: parameter {i} differs from {ref_name} by {(a - b).abs().max().item():.3g}"
    sa, sb = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert sa.keys() == sb.keys(), f"{name}: state entries differ from {ref_name}"
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), f"{name}: state keys of {k} differ from {ref_name}"
        for key, va in sa[k].items():
            vb = sb[k][key]
            same = torch.equal(local(va), local(vb)) if isinstance(va, torch.Tensor) else va == vb
            assert same, f"{name}: state {k}.{key} differs from {ref_name}"
