"""What watches the training iterations, built only when the policy asks: the step timer, the
TensorBoard writer (rank 0) and the autotuner. ``attach`` returns the function that takes them down."""


def attach(runtime):
    policy = runtime.policy
    logdir = policy.logging.tensorboard_dir
    if not (policy.autotune.enabled or logdir):
        return lambda: None
    from .step_timer import StepTimer
    timer = StepTimer(runtime, breakdown=bool(logdir))
    board = None
    if logdir:
        from .tb_writer import Board
        board = Board(logdir, timer)
    if policy.autotune.enabled:
        from .autotune import Autotuner
        Autotuner(runtime, timer, board)

    def close():
        if board is not None:
            board.close()
        timer.close()
    return close
