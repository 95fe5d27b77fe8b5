"""enable() and disable() at any moment leave a run's results those of the unpatched run, bit for
bit, and disable() leaves every original in place: from another thread while one trains (many
toggles, landing in every part of the step), and from a signal handler that interrupts the
training thread itself (a timer firing at ever different points of the step: inside the swap of
flat chunks, between a chunk's update in backward and the step that finishes it, inside mode
forward's deferred updates).
"""

import random
import signal
import sys
import threading
import time
import traceback

import pytest
import torch

from autopatch.patches.ledger import LEDGER
from test_disable import assert_no_hooks, global_hooks
from training import assert_same, assert_state_equal, batches, mlp, weights

MODES = ["multi_layer", "backward", "forward"]
DATA = batches(16)
STEPS = 400


@pytest.fixture(autouse=True)
def torch_thread(one_thread):
    """One torch thread: the tensors are tiny, and two threads on two shared cores only add noise."""


def job():
    model = mlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps, first=0, done=None):
    """``done``: a one-item list counting the steps done, for a toggler to follow."""
    for i in range(first, first + steps):
        x, y = DATA[i % len(DATA)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if done is not None:
            done[0] += 1


class Schedule:
    """When to toggle next: after a random number of steps on (half the time long enough for
    ``mode`` to fuse: backward arms after its first step; else within the step where it was
    enabled) or off."""

    def __init__(self, seed):
        self.rnd = random.Random(seed)

    def steps_to_next(self, enabled):
        if enabled:
            return self.rnd.choice((0, self.rnd.randint(1, 6)))
        return self.rnd.randint(0, 2)


def unpatched(steps):
    model, opt = job()
    train(model, opt, steps)
    return model, opt


def originals():
    return dict(vars(torch.optim.Optimizer)), dict(vars(torch.nn.Module)), dict(vars(torch)), global_hooks()


def assert_as_unpatched(model, opt, plain, before):
    """The weights and the optimizer's state are the unpatched run's; torch is as it was."""
    plain_model, plain_opt = plain
    assert_same(weights(model), weights(plain_model))
    assert_state_equal(opt.state_dict(), plain_opt.state_dict())
    assert_no_hooks(opt, model)
    assert LEDGER.installed() == {}
    for was, now in zip(before[:3], originals()[:3]):
        assert now.keys() == was.keys()
        assert not [k for k in was if now[k] is not was[k]]
    assert global_hooks() == before[3]
    assert type(opt.state) is type(plain_opt.state)     # not the pending-aware proxy of mode forward


@pytest.mark.parametrize("mode", MODES)
def test_toggling_from_another_thread_changes_nothing(ap, mode):
    """The main thread toggles 150 times while a thread trains, each toggle at a random moment of
    a step, a step or two apart; the thread trains until the last one, then as many steps as it
    took are run unpatched."""
    started = time.perf_counter()
    unpatched(50)
    step_seconds = (time.perf_counter() - started) / 50
    before = originals()
    model, opt = job()
    done, failed, stop = [0], [], threading.Event()

    def training():
        try:
            while not stop.is_set():
                train(model, opt, 1, first=done[0], done=done)
        except BaseException:
            failed.append(traceback.format_exc())

    trainer = threading.Thread(target=training)
    rnd = random.Random(mode)
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # the threads take turns every few bytecodes: a toggle lands anywhere
    try:
        trainer.start()
        for _ in range(150):
            if ap.is_enabled():
                ap.disable()
                assert LEDGER.installed() == {}      # disable() returns with every original in place
            else:
                ap.enable(mode=mode)
            until = done[0] + rnd.randint(0, 2)
            while done[0] < until and trainer.is_alive():
                time.sleep(0.0002)
            time.sleep(rnd.random() * step_seconds)     # a random moment of the next step
        stop.set()
        trainer.join()
    finally:
        sys.setswitchinterval(switching)
    ap.disable()
    assert not failed, failed[0]
    assert_as_unpatched(model, opt, unpatched(done[0]), before)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first", ["disable", "enable"])
def test_a_signal_handler_toggling_mid_step_changes_nothing(ap, mode, first):
    """SIGALRM fires every 0.2-1 ms; once the schedule's steps are done its handler toggles, at
    whatever point of a step the signal landed. ``first``: what the handler calls first (the run
    starts enabled for ``disable``); the run is disabled at the end."""
    plain = unpatched(STEPS)
    before = originals()
    if first == "disable":
        ap.enable(mode=mode)
    schedule = Schedule(seed=mode + first)
    done, toggles = [0], []
    next_at = [schedule.steps_to_next(ap.is_enabled())]

    def on_alarm(signum, frame):
        if stopping:
            return      # a signal that arrived as the timer was stopped must not start it again
        if done[0] >= next_at[0]:
            if ap.is_enabled():
                ap.disable()
            else:
                ap.enable(mode=mode)
            toggles.append(done[0])
            next_at[0] = done[0] + schedule.steps_to_next(ap.is_enabled())
        signal.setitimer(signal.ITIMER_REAL, 0.0002 + schedule.rnd.random() * 0.0008)

    model, opt = job()
    stopping = []
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001)
        train(model, opt, STEPS, done=done)
    finally:
        # Its handler may still run once after the timer is stopped (the signal came just before)
        # and would start it again: SIGALRM with the default action then ends the process.
        stopping.append(True)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    ap.disable()
    assert len(toggles) >= 20
    assert_as_unpatched(model, opt, plain, before)


@pytest.mark.parametrize("mode", MODES)
def test_disable_and_checkpoint_from_a_handler_mid_step(ap, mode, tmp_path):
    """A SIGTERM handler that disables and checkpoints, the signal sent by another thread while
    the training thread is inside step(): disable() returns at once, the checkpoint is one an
    unpatched run loads (in mode multi_layer, the weights and state from before that step; modes
    backward and forward have made part of the step's update by then, as a read inside the step
    sees it), the originals are back when that step() returns, and the run goes on as unpatched."""
    steps = 40
    plain = unpatched(steps)
    checkpoint_plain = unpatched(5)
    before = originals()
    ap.enable(mode=mode)
    model, opt = job()
    seen = {}

    def on_term(signum, frame):
        ap.disable()
        seen["returned"] = not ap.is_enabled()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")

    def during_step(opt_, args, kwargs):
        sender = threading.Thread(target=signal.raise_signal, args=(signal.SIGTERM,))
        sender.start()
        sender.join()
        time.sleep(0.01)             # the handler runs at the next bytecode of this thread

    train(model, opt, 5)
    previous = signal.signal(signal.SIGTERM, on_term)
    hook = opt.register_step_pre_hook(during_step)
    try:
        train(model, opt, 1, first=5)
    finally:
        hook.remove()
        signal.signal(signal.SIGTERM, previous)
    assert seen["returned"]      # at once, the step still under way
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed, resumed_opt = job()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    assert saved["opt"]["param_groups"] == checkpoint_plain[1].state_dict()["param_groups"]
    if mode == "multi_layer":
        assert_same(list(saved["model"].values()), weights(checkpoint_plain[0]))
        assert_state_equal(saved["opt"], checkpoint_plain[1].state_dict())
    train(model, opt, steps - 6, first=6)
    assert_as_unpatched(model, opt, plain, before)


@pytest.mark.parametrize("where", ["this thread", "another thread"])
def test_a_step_that_raised_holds_no_toggle_back(ap, where):
    """A step whose closure raised never reached the hook that ends it: disable() right after
    (on the same thread, as a ``finally:`` would, or from another one) neither waits nor defers."""
    ap.enable(mode="multi_layer")
    model, opt = job()
    train(model, opt, 3)

    def failing():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        opt.step(failing)
    started = time.monotonic()
    if where == "this thread":
        ap.disable()
    else:
        other = threading.Thread(target=ap.disable)
        other.start()
        other.join()
    assert time.monotonic() - started < 1
    assert LEDGER.installed() == {}
    assert_no_hooks(opt, model)


@pytest.mark.parametrize("mode", MODES)
def test_a_toggle_while_a_step_begins_leaves_the_programs_own_step_hooks_working(ap, mode):
    """The program has step pre-hooks of its own on the optimizer (registered after autopatch's)
    and global ones, registered before autopatch's and after it. Another thread's disable() comes
    while a step has begun but not yet reached autopatch's hooks: the step waits for it (inside
    torch's loop over the global hooks), then goes on through the program's hooks, which run, and
    trains as unpatched; nothing of autopatch's is left in torch's dicts once the step is over."""
    import torch.optim.optimizer as optimizer_module
    steps, at = 12, 6
    plain = unpatched(steps)
    before = originals()
    calls, after_calls, begun, failed = [], [], threading.Event(), []

    def before_any_step(opt_, args, kwargs):
        if len(calls) == at:
            begun.set()
            time.sleep(0.3)      # the other thread's disable() is pending by now
    global_handle = optimizer_module.register_optimizer_step_pre_hook(before_any_step)
    later_handle = None
    try:
        ap.enable(mode=mode)
        later_handle = optimizer_module.register_optimizer_step_pre_hook(lambda *_: after_calls.append(1))
        model, opt = job()
        own_handle = opt.register_step_pre_hook(lambda *_: calls.append(1))

        def training():
            try:
                train(model, opt, steps)
            except BaseException:
                failed.append(traceback.format_exc())
        trainer = threading.Thread(target=training)
        trainer.start()
        assert begun.wait(60)
        ap.disable()
        trainer.join(60)
        own_handle.remove()
        ap.enable(mode=mode)      # autopatch's global hook entry is gone by the next toggle at the latest
        ap.disable()
        assert list(optimizer_module._global_optimizer_pre_hooks) == [global_handle.id, later_handle.id]
    finally:
        global_handle.remove()
        if later_handle is not None:
            later_handle.remove()
    assert not failed, failed[0]
    assert len(calls) == len(after_calls) == steps
    assert_as_unpatched(model, opt, plain, before)
