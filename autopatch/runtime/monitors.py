"""What watches the training iterations, built only when the policy asks: the step timer (for the
report's breakdown, on by default), the TensorBoard writer (rank 0) and the autotuner. ``attach``
returns the function that takes them down."""


def attach(session):
    policy = session.policy
    logdir = policy.logging.tensorboard_dir
    breakdown = policy.logging.breakdown
    if not (policy.autotune.enabled or logdir or breakdown):
        return lambda: None
    from ..reporting.step_timer import StepTimer
    timer = StepTimer(session, breakdown=breakdown or bool(logdir))
    if breakdown:
        from ..reporting.breakdown import Breakdown
        session.add_report_section("breakdown", Breakdown(timer, session).describe)
    board = None
    if logdir:
        from ..reporting.tensorboard import Board
        board = Board(logdir, timer, session)
    if policy.autotune.enabled:
        from ..autotune import Autotuner
        Autotuner(session, timer, board)

    def close():
        if board is not None:
            board.close()
        timer.close()
    return close
