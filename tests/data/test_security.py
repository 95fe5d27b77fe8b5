"""Another local user can neither read the cache nor make the training process run code through
it: the key and the store are this user's alone (0700 directories, 0600 files), the Redis
password is in no command line and no store, the server listens on the address it is given only,
and paths another user owns or links are refused.

The other user is ``nobody``, reached with ``setpriv`` from root; it runs Python's standard
library only (``/usr/bin/python3``), as an attacker's script would."""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from autopatch.data.store.redis_server import RedisServer
from autopatch.private_files import NotPrivate, private_dir
from spawn import SUPPORT, clean_env, patience, run_python, spawn_two_ranks

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                                reason="needs root, setpriv and /usr/bin/python3 to act as a second local user")

ATTACK = r"""
import json, os, socket, sys
port, pid, key, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
out = {"uid": os.getuid()}

def attempt(name, fn):
    try:
        out[name] = fn()
    except OSError as e:
        out[name] = f"denied: {type(e).__name__}"

attempt("cmdline", lambda: open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
attempt("environ", lambda: open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
attempt("key", lambda: open(key, "rb").read().hex())
attempt("store_listing", lambda: os.listdir(store))
attempt("store_data", lambda: open(os.path.join(store, "data.mdb"), "rb").read(64).hex())
attempt("store_write", lambda: open(os.path.join(store, "planted"), "wb").write(b"x"))

def redis(*words):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"".join(f"*{len(words)}\r\n".encode() + b"".join(
            f"${len(w)}\r\n{w}\r\n".encode() for w in words) for words in [words]))
        return s.recv(200).decode(errors="replace")

attempt("redis_ping", lambda: redis("PING"))
attempt("redis_set", lambda: redis("SET", "x", "y"))
words = out["cmdline"].split() if not out["cmdline"].startswith("denied") else []
attempt("redis_auth_with_cmdline", lambda: [redis("AUTH", w) for w in words])
print(json.dumps(out))
"""


def _children(pid):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            pass
    return found


@pytest.fixture
def shared_place():
    """A directory every local user may traverse (as /home or /tmp are), removed afterwards."""
    path = tempfile.mkdtemp(prefix="autopatch-shared-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@needs_root
def test_another_user_cannot_read_the_cache_or_reach_redis(shared_place, installed):
    home_cache = os.path.join(shared_place, "cache-home")
    store = os.path.join(home_cache, "autopatch", "data")
    os.makedirs(store, mode=0o755)            # as an earlier version left it
    os.chmod(os.path.join(home_cache, "autopatch"), 0o755)
    os.chmod(store, 0o755)
    env = dict(OMP_NUM_THREADS=1, FUSEDOPT_ENABLE=1, XDG_CACHE_HOME=home_cache)
    done = run_python([SUPPORT / "data_job.py", os.path.join(shared_place, "local.pt")],
                      env=clean_env(FUSEDOPT_DATA_CACHE=1, **env))
    assert done.returncode == 0, done.stderr
    key = os.path.join(home_cache, "autopatch", "key")
    assert (_mode(os.path.join(home_cache, "autopatch")), _mode(store), _mode(key)) == (0o700, 0o700, 0o600)
    assert all(_mode(os.path.join(store, f)) == 0o600 for f in os.listdir(store))

    job = subprocess.Popen([sys.executable, str(SUPPORT / "data_job.py"), os.path.join(shared_place, "redis.pt"),
                            "--wait-for-signal"], env=clean_env(FUSEDOPT_DATA_CACHE="redis", **env),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "ready", job.stderr.read()
        server = next(p for p in _children(job.pid) if "redis-server" in open(f"/proc/{p}/cmdline").read())
        with open(f"/proc/{server}/cmdline") as f:
            port = int(f.read().strip("\0").rpartition(":")[2])
        attack = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                 "/usr/bin/python3", "-c", ATTACK, str(port), str(server), key, store],
                                capture_output=True, text=True, timeout=patience(60), env={"HOME": "/"})
    finally:
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=patience(60))
    assert attack.returncode == 0, attack.stderr
    seen = json.loads(attack.stdout)
    assert seen["uid"] == NOBODY
    import hashlib
    import hmac
    with open(key, "rb") as f:
        password = hmac.digest(f.read(), b"autopatch redis password", hashlib.sha256).hex()
    assert password not in seen["cmdline"] and "requirepass" not in seen["cmdline"], seen["cmdline"]
    for what in ("environ", "key", "store_listing", "store_data", "store_write"):
        assert seen[what].startswith("denied"), (what, seen[what])
    assert seen["redis_ping"].startswith("-NOAUTH") and seen["redis_set"].startswith("-NOAUTH"), seen
    assert not any(r.startswith("+OK") for r in seen["redis_auth_with_cmdline"]), seen


@needs_root
def test_paths_another_user_owns_or_links_are_refused(shared_place, monkeypatch):
    theirs = os.path.join(shared_place, "autopatch-data-0")   # the temp-dir store's name, squatted
    os.mkdir(theirs, 0o777)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(NotPrivate, match="owned by uid 65534"):
        private_dir(theirs)
    mine = private_dir(os.path.join(shared_place, "mine"))
    link = os.path.join(shared_place, "link")
    os.symlink(mine, link)
    with pytest.raises(NotPrivate):
        private_dir(link)
    from autopatch.data import CacheLoader
    loader = CacheLoader("local", "squatted", path=theirs)
    assert loader.unavailable and "owned by uid 65534" in loader.unavailable
    # a key file planted by someone else is not used
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(shared_place, "home"))
    root = private_dir(os.path.join(shared_place, "home", "autopatch"))
    with open(os.path.join(root, "key"), "wb") as f:
        f.write(bytes(32))
    os.chown(os.path.join(root, "key"), NOBODY, NOBODY)
    from autopatch.data.store.user_key import KeyUnusable, user_key
    with pytest.raises(KeyUnusable, match="owned by uid 65534"):
        user_key()


def test_a_server_listens_on_the_address_it_is_given_only():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 1))   # the default route's interface (no packet is sent)
            address = s.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    server = RedisServer(16 << 20, bind=address, advertise=address)
    try:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
        socket.create_connection((address, server.port), timeout=2).close()
        assert server.address == f"redis://{address}:{server.port}/0"
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_password_is_in_no_argument_of_the_server():
    """redis-server retitles itself once it runs, so ``/proc/PID/cmdline`` hides its arguments
    after start-up only: until then every local user can read them."""
    server = RedisServer(16 << 20)
    try:
        argv = " ".join(map(str, server.process.args))
        assert server.password not in argv and "requirepass" not in argv, argv
    finally:
        server.stop()


def _machine_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 1))   # the default route's interface (no packet is sent)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def test_a_node_server_listens_on_the_address_other_nodes_reach_only(tmp_path_factory):
    """Two ranks as two nodes: each node's server answers on the address the others reach it by
    and nowhere else (not on every interface, not on loopback)."""
    address = _machine_address()
    if address.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    results, outputs, codes = spawn_two_ranks("data_worker.py", "two_nodes", tmp_path_factory, timeout=120)
    assert codes == [0, 0] and len(results) == 2, "\n".join(outputs)
    for r in results.values():
        assert r["urls"][0] != r["urls"][1] and all(f"@{address}:" in u for u in r["urls"]), r
        assert r["answers"][address] is True and str(r["answers"]["127.0.0.1"]).startswith("refused"), r
