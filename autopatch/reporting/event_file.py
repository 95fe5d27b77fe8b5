"""A TensorBoard event file written in the calling thread.

torch's SummaryWriter writes from a thread of its own: a full disk fails there (a traceback on
stderr) and again, later, in whichever call writes next. Here each write happens in the call
that makes it, so the TensorBoard writer catches its own failures where they happen. Only
tensorboard's protos and record framing are used (no TensorFlow, no torch).
"""

import itertools
import os
import socket
import time

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

_serial = itertools.count()


class EventFile:
    """A new ``events.out.tfevents.*`` file in ``folder`` (a files.Folder), as TensorBoard names them."""

    def __init__(self, folder):
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_serial)}"
        self._file = folder.open(name, exclusive=True)
        self._records = RecordWriter(self._file)
        self._write(event_pb2.Event(file_version="brain.Event:2"))

    def add_summary(self, summary, step=None):
        event = event_pb2.Event(summary=summary)
        if step is not None:
            event.step = int(step)
        self._write(event)

    def add_scalar(self, tag, value, step):
        value = summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
        self.add_summary(summary_pb2.Summary(value=[value]), step)

    def _write(self, event):
        event.wall_time = time.time()
        self._records.write(event.SerializeToString())

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()
