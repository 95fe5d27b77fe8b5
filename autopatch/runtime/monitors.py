"""What watches the training iterations, built only when the policy asks: the step timer, the
TensorBoard writer (rank 0) and the autotuner. ``attach`` returns the function that takes them down."""


def attach(session):
    policy = session.policy
    logdir = policy.logging.tensorboard_dir
    if not (policy.autotune.enabled or logdir):
        return lambda: None
    from ..reporting.step_timer import StepTimer
    timer = StepTimer(session, breakdown=bool(logdir))
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
