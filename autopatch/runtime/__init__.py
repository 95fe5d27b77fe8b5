"""The running state of an enabled autopatch, and the session object ``enable()`` returns.

Data flows one way: the policy configures the runtime, which adopts every optimizer (modes/ choose
and run its mode with the strategies of fusion/), takes over DDP's gradient sync (comm/), and
attaches the monitors the policy asks for (autotune/, and reporting/'s step timer and TensorBoard
writer); the report reads what each room describes.
"""

from .runtime import Runtime
from .session import Session

__all__ = ["Runtime", "Session"]
