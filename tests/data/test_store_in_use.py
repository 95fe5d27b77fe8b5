"""A local store opened while another process writes into it (the other DataLoader workers of a
job, another job on the node) is used as it is: the check that starts a file cut short afresh
never mistakes a file growing under its writer for one, and never fails on it."""

import multiprocessing
import subprocess
import sys

from autopatch.data import LocalStore
from spawn import clean_env, patience

CAPACITY = 1 << 30
OPENINGS = 60
# Commits a millisecond apart until told to stop (a line on stdin), 60 s or 400,000 entries at most.
WRITER = f"""
import os, sys, threading, time
from autopatch.data import LocalStore
store = LocalStore(sys.argv[1], capacity={CAPACITY})
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("ready", flush=True)
end, written = time.monotonic() + 60, 0
while not stop.is_set() and time.monotonic() < end and written < 400000:
    store.mset({{f"w{{written + j}}": os.urandom(200) for j in range(16)}})
    written += 16
    time.sleep(0.001)
print(written)
"""


def opened(path, answers):
    """What a process opening the store finds: why it was started afresh or could not open it (None
    when neither), and its entries."""
    try:
        store = LocalStore(path, capacity=CAPACITY)
        answers.put((store.repaired, store.num_keys()))
    except Exception as e:
        answers.put((f"{type(e).__name__}: {e}", -1))


def test_a_store_opened_while_another_process_writes_is_never_started_afresh(tmp_path):
    path = str(tmp_path / "cache")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=clean_env())
    assert writer.stdout.readline().strip() == "ready"
    fork = multiprocessing.get_context("fork")
    answers, found = fork.Queue(), []
    while writer.poll() is None and len(found) < OPENINGS:
        opener = fork.Process(target=opened, args=(path, answers))
        opener.start()
        found.append(answers.get(timeout=patience(60)))
        opener.join()
    written = int(writer.communicate("stop\n", timeout=patience(60))[0])
    assert len(found) == OPENINGS, "the writer ended before the store was opened beside it"
    assert [why for why, _ in found if why is not None] == []   # found before: 'cut to 2822144 of the 3284992 bytes'
    counts = [n for _, n in found]
    assert counts == sorted(counts)   # a reader never finds fewer entries than one before it
    assert LocalStore(path, capacity=CAPACITY).num_keys() == written
