"""Patch/unpatch orderings, each in a fresh interpreter, against one unpatched run of the same job.

Every variant trains the same seeded Adam job for six steps, fused (multi_layer) or with mode off;
its losses and final weights must be bit-for-bit those of the unpatched run, and the report must
count the steps taken while enabled.
"""

import json
import textwrap

import pytest

from spawn import clean_env, run_python, write_script

HEAD = """
    import json, sys
    facts = {}
"""
JOB = """
    import torch
    from training import batches, digest, mlp, train
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(6)
"""
TAIL = """
    import autopatch
    print(json.dumps({"losses": losses, "digest": digest(model), "report": autopatch.report(),
                      "facts": facts}))
"""
INIT = "vars(torch.optim.Optimizer)['__init__']"

VARIANTS = {
    "before_torch_import": ("""
        import autopatch
        autopatch.enable()
        facts["torch_loaded"] = "torch" in sys.modules
    """, JOB, """
        losses = train(model, opt, data)
    """),
    "after_torch_import": ("""
        import torch
        import autopatch
        autopatch.enable()
    """, JOB, """
        losses = train(model, opt, data)
    """),
    "after_optimizer_built_and_stepped": (JOB, """
        losses = train(model, opt, data[:3])
        import autopatch
        autopatch.enable()
        losses += train(model, opt, data[3:])
    """),
    "enable_disable_enable": ("""
        import torch
        original = vars(torch.optim.Optimizer)["__init__"]
        import autopatch
        autopatch.enable()
    """, JOB, f"""
        losses = train(model, opt, data[:2])
        facts["patched_while_enabled"] = {INIT} is not original
        autopatch.disable()
        facts["restored_after_disable"] = {INIT} is original
        losses += train(model, opt, data[2:4])
        autopatch.enable()
        facts["wrapped_once"] = {INIT}.__wrapped__ is original
        losses += train(model, opt, data[4:])
        autopatch.disable()
        facts["restored_at_end"] = {INIT} is original
    """),
    "enable_disable_before_torch_import": ("""
        import autopatch
        autopatch.enable()
        autopatch.disable()
        import torch
        original = vars(torch.optim.Optimizer)["__init__"]
        facts["untouched_by_disabled_hook"] = not hasattr(original, "__wrapped__")
        autopatch.enable()
        facts["wrapped_once"] = vars(torch.optim.Optimizer)["__init__"].__wrapped__ is original
    """, JOB, """
        losses = train(model, opt, data)
    """),
    "mode_off_argument": ("""
        import autopatch
        autopatch.enable(mode="off")
    """, JOB, """
        losses = train(model, opt, data)
    """),
    "safe_policy_zero_code": (JOB, """
        losses = train(model, opt, data)
    """),
}
# variant -> (steps the report counts, mode, facts that must be true)
EXPECT = {
    "before_torch_import": (6, "multi_layer", {"torch_loaded": False}),
    "after_torch_import": (6, "multi_layer", {}),
    "after_optimizer_built_and_stepped": (3, "multi_layer", {}),
    "enable_disable_enable": (2, "multi_layer", {"patched_while_enabled": True, "restored_after_disable": True,
                                                 "wrapped_once": True, "restored_at_end": True}),
    "enable_disable_before_torch_import": (6, "multi_layer", {"untouched_by_disabled_hook": True,
                                                              "wrapped_once": True}),
    "mode_off_argument": (6, "off", {}),
    "safe_policy_zero_code": (6, "off", {}),
}


def _run(tmp_path, name, pieces, **env):
    script = write_script(tmp_path / f"{name}.py", "".join(textwrap.dedent(p) for p in (HEAD, *pieces, TAIL)))
    res = run_python([script], env=clean_env(**env), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory):
    out = _run(tmp_path_factory.mktemp("unpatched"), "unpatched", (JOB, "losses = train(model, opt, data)\n"))
    assert out["report"]["enabled"] is False and out["report"]["optimizers"] == []
    return out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ordering_trains_bit_for_bit_and_is_intercepted(tmp_path, unpatched, name):
    if name == "safe_policy_zero_code":
        env = {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_POLICY": "safe"}
    else:   # a fixed fused mode: each ordering must really run fused, not only be counted
        env = {"FUSEDOPT_MODE": "multi_layer"}
    out = _run(tmp_path, name, VARIANTS[name], **env)
    assert out["losses"] == unpatched["losses"]
    assert out["digest"] == unpatched["digest"]
    steps, mode, facts = EXPECT[name]
    [opt] = out["report"]["optimizers"]
    assert opt["class"] == "torch.optim.adam.Adam" and opt["params"] == 14
    assert (opt["steps"], opt["mode"]) == (steps, mode), opt
    assert opt["reason"]
    assert {k: out["facts"].get(k) for k in facts} == facts
