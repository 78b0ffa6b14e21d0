"""Shared memory between users on one host, against the real lossd_server binary.

The server runs as root (the test's user), which is the worst case for a server that opened
whatever memory a client named: root could open any process's descriptors. Two client processes
run as two other users (created here when missing): A hands a memfd of its own rows over and
keeps it; B, knowing A's pid, descriptor number and (later) A's revoked handle, tries every way
the protocol offers to get results from A's memory or to write dL/dh into it. Nothing may come
back to B, A's memfd must stay byte for byte as A wrote it, and A's calls, and B's calls on its
own memory, must work and agree with the message path bit for bit.
"""
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest

from server_process import ServerProcess, ensure_python_client

ensure_python_client()
import lossd  # noqa: E402

USERS = ("lossd-test-shm-a", "lossd-test-shm-b")
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_memory_user.py")
VOCAB, HIDDEN = 1000, 32


def ensure_user(name):
    """The user `name`, created (without a home or login shell) unless it exists: the test can
    run again and again."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    result = subprocess.run(["useradd", "--system", "--no-create-home",
                             "--shell", "/usr/sbin/nologin", name],
                            capture_output=True, text=True)
    # 9: another run created it meanwhile.
    if result.returncode not in (0, 9):
        raise OSError(f"useradd {name}: exit {result.returncode}: {result.stderr.strip()}")
    return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        pytest.skip("creating users and running clients as them needs root")
    for tool in ("useradd", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} on this host to create the test's users and run as them")
    return [ensure_user(name) for name in USERS]


@pytest.fixture(scope="module")
def client_dir():
    """The lossd package (with its stubs) and the helper, where other users can read them: the
    checkout and the build tree may sit under a directory only root enters."""
    directory = tempfile.mkdtemp(prefix="lossd-shm-users-")
    shutil.copytree(os.path.dirname(lossd.__file__), os.path.join(directory, "lossd"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HELPER, directory)
    for root, _, files in os.walk(directory):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}",
                       f"--demo_hidden_size={HIDDEN}", metrics=False) as s:
        yield s


def run_as(user, client_dir, *args, **popen):
    # setpriv (util-linux) changes the user rather than Popen(user=...): that would fork this
    # process, whose gRPC threads' fork handlers can hang the fork, where Popen otherwise spawns.
    return subprocess.Popen(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--",
         sys.executable, os.path.join(client_dir, "shared_memory_user.py"), *args],
        env={"PYTHONPATH": client_dir, "HOME": client_dir, "OMP_NUM_THREADS": "1",
             "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        cwd=client_dir, text=True, **popen)


def intrude(user, client_dir, server, head, victim):
    process = run_as(user, client_dir, "intruder", server.address, head, json.dumps(victim),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_client_of_another_user_reaches_nothing_of_its_memory(users, client_dir, server):
    user_a, user_b = users
    assert user_a.pw_uid != user_b.pw_uid and 0 not in (user_a.pw_uid, user_b.pw_uid)
    head = f"users-{uuid.uuid4().hex[:8]}"
    with lossd.Client(server.address, timeout=600) as root_client:
        weight = np.random.default_rng().standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.3
        root_client.upload_head(head, weight)

        owner = run_as(user_a, client_dir, "owner", server.address, head,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            def ask(command):
                owner.stdin.write(command + "\n")
                owner.stdin.flush()
                line = owner.stdout.readline()
                assert line, owner.stderr.read()
                return json.loads(line)

            first = owner.stdout.readline()
            assert first, owner.stderr.read()
            victim = json.loads(first)
            # A's own calls: through its memfd as through messages, bit for bit.
            assert victim["shared_matches_messages"]
            tokens_before = root_client.get_head(head).accumulated_tokens

            seen = intrude(user_b, client_dir, server, head, victim)
            assert seen["open_proc_fd"] == "PermissionError"
            for attempt, code in (("pid_and_fd", "INVALID_ARGUMENT"),
                                  ("random_handle", "NOT_FOUND"),
                                  ("zero_handle", "NOT_FOUND"),
                                  ("short_handle", "INVALID_ARGUMENT")):
                status, results, message = seen[attempt]
                assert (status, results) == (code, 0), (attempt, seen[attempt])
                assert "shared_memory.handle" in message, (attempt, message)
            # With its own handle beside A's pid and fd, the server read B's rows and wrote B's
            # memfd: the old fields are ignored.
            assert seen["own_memory_with_pid_and_fd"] == {
                "rows_were_its_own": True, "grad_hidden_in_its_own_memfd": True}
            # B, a user other than the server's, uses shared memory for its own memory.
            assert seen["own_calls_match_messages"]
            check = ask("check")
            assert check == {"memfd_unchanged": True, "calls_still_work": True}

            # A's connection closes: its handle is revoked, whoever learns it later.
            handle = victim["handle"]
            assert ask("revoke") == {"revoked": True}
            seen = intrude(user_b, client_dir, server, head, dict(victim, revoked_handle=handle))
            status, results, message = seen["revoked_handle"]
            assert (status, results) == ("NOT_FOUND", 0), seen["revoked_handle"]
            assert "shared_memory.handle" in message
            assert seen["release_revoked_handle"] == "NOT_FOUND"
            assert ask("check") == {"memfd_unchanged": True, "calls_still_work": True}
            # Only the call on B's own memory accumulated (one per intrusion, 8 tokens each):
            # none of the refused ones did.
            assert root_client.get_head(head).accumulated_tokens == tokens_before + 2 * 8
            owner.stdin.write("exit\n")
            owner.stdin.flush()
            assert owner.wait(timeout=600) == 0, owner.stderr.read()
        finally:
            if owner.poll() is None:
                owner.kill()
                owner.wait()


def test_one_user_cannot_take_every_handover_connection_or_handle(users, client_dir, server):
    """A takes all the handover connections and handles the server gives one user; B, and the
    server's own user, still hand memory over and compute through it."""
    user_a, user_b = users
    hog = run_as(user_a, client_dir, "hog", server.address,
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = hog.stdout.readline()
        assert line, hog.stderr.read()
        held = json.loads(line)
        # 16 connections of the server's 32; 128 handles of its 256.
        assert held["connections"] == 16, held
        code, message = held["connection_refused"]
        # Or a reset or broken pipe, when the refusal came only after the helper had sent its
        # request (see the helper).
        assert (code == "RESOURCE_EXHAUSTED" and "per local user" in message
                and f"uid {user_a.pw_uid}" in message) or (
                    code == "UNAVAILABLE" and ("reset" in message or "Broken pipe" in message)), held
        assert held["handles"] == 128, held
        code, message = held["handle_refused"]
        assert code == "RESOURCE_EXHAUSTED" and "per local user" in message, held

        head = f"users-{uuid.uuid4().hex[:8]}"
        with lossd.Client(server.address, timeout=600) as root_client:
            weight = np.random.default_rng().standard_normal((VOCAB, HIDDEN), dtype=np.float32)
            root_client.upload_head(head, weight)
        # B's calls through its own memfd work while A holds its share (and agree with the
        # message path bit for bit).
        seen = intrude(user_b, client_dir, server, head, {
            "pid": 1, "fd": 3, "labels": [0] * 8, "grad_offset": 8 * HIDDEN * 4})
        assert seen["own_calls_match_messages"], seen
        # And so do the server's own user's.
        with lossd.Client(server.address, timeout=600, shared_memory=True) as root_client:
            hidden = np.random.default_rng().standard_normal((4, HIDDEN), dtype=np.float32)
            out = root_client.compute(head, hidden, labels=np.arange(4))
            assert np.isfinite(out.loss)
    finally:
        hog.stdin.close()
        assert hog.wait(timeout=600) == 0, hog.stderr.read()
