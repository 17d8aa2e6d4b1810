"""``fmtl-supernode``: ``flower-supernode`` that rejoins after a crash and says why it stops.

Usage: ``fmtl-supernode [--state-file F] [--activation-wait S] FLOWER_SUPERNODE_ARGS...``.
Every argument it does not know goes to ``flower-supernode`` unchanged; its output is passed
through line by line. What it adds (flwr 1.41/1.42, node authentication on):

* **A device back within the heartbeat window rejoins.** A SuperNode that crashed or lost
  power could not deactivate its node id, and the SuperLink counts that id online until
  ``HEARTBEAT_PATIENCE`` x 30 s pass without a heartbeat; meanwhile ``flower-supernode``
  with the same key exits with ``[code: 2004] Failed to activate SuperNode``. The launcher
  then releases the old id itself: the Fleet API's ``DeactivateNode``, signed with the
  device's key, which the SuperLink accepts only for the node id registered for that key
  (the id is read from ``SuperNode ID: <id>`` once the node was activated and kept in
  ``--state-file``). Without a recorded id, or when the release is refused, it starts
  ``flower-supernode`` again with a growing pause (2, 4, 8, then 15 s) until the old id
  has expired, for ``--activation-wait`` seconds (default 150), then exits 2 with a hint:
  the key is probably not registered.
* **A SuperNode the SuperLink no longer knows exits non-zero.** After a SuperLink lost its
  database (or the node was unregistered) ``flower-supernode`` logs a traceback ending in
  ``401 Unauthorized`` and exits 0. The launcher exits 3 and says how to register the
  device's public key again (the command, with the key).
* **No ClientApp process waits for a stopped run.** A ``flwr-clientapp`` started for a
  message that ``flower-supernode`` gave up ("Run ID ... is not in `RUNNING` status. Ignoring
  message ...") would wait up to 2 h for the message's content; it is stopped
  (:class:`OrphanReaper` says why, with flwr's code locations).
* SIGTERM and SIGINT are passed on to ``flower-supernode`` (which deactivates its node id
  on the way out); the launcher then exits with its status.

Exit status: that of ``flower-supernode``, except 2 (never activated within
``--activation-wait``) and 3 (the SuperLink stopped recognising the node).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: Exit status when activation was refused for the whole ``--activation-wait``.
EXIT_NOT_ACTIVATED = 2
#: Exit status when the SuperLink answered 401 after the node was activated.
EXIT_UNAUTHORIZED = 3
#: Pauses between attempts, seconds (the last one repeats).
BACKOFF_S = (2.0, 4.0, 8.0, 15.0)
#: Default seconds to keep trying after the first refusal: the heartbeat window
#: (HEARTBEAT_PATIENCE x HEARTBEAT_DEFAULT_INTERVAL = 60 s in flwr 1.41/1.42) and margin.
DEFAULT_ACTIVATION_WAIT_S = 150.0

#: Seconds to let the output thread catch up once flower-supernode has exited.
OUTPUT_GRACE_S = 2.0

ACTIVATED = re.compile(r"SuperNode ID: (\d+)")
REFUSED = "[code: 2004]"
UNAUTHORIZED = "401 Unauthorized"
#: flower-supernode gave up a message of a run that is no longer RUNNING after it had
#: created the message's task (start_client_internal._pull_and_store_message).
IGNORED = re.compile(r"Run ID \d+ is not in `RUNNING` status\. Ignoring message ")
#: flower-supernode starts handling a message pulled from the SuperLink.
RECEIVING = "Receiving: "
#: Seconds between two looks for ClientApp processes to reap.
REAP_POLL_S = 0.5


# ----------------------------------------------------------------------------- arguments

@dataclass(frozen=True)
class SuperNodeArgs:
    """What the launcher needs of ``flower-supernode``'s own arguments."""

    superlink: str
    insecure: bool
    root_certificates: str | None
    private_key: str | None


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], SuperNodeArgs]:
    """The launcher's options, the arguments for ``flower-supernode``, and what they say."""
    own = argparse.ArgumentParser(
        prog="fmtl-supernode", allow_abbrev=False,
        description="flower-supernode that rejoins after a crash (releases or waits out "
                    "its old node id) and exits non-zero with a hint when the SuperLink "
                    "no longer knows it. Other arguments go to flower-supernode.")
    own.add_argument("--state-file", type=Path, default=None,
                     help="where the node id is recorded (default: "
                          "$FLWR_HOME/fmtl-supernode.json, FLWR_HOME defaulting to ~/.flwr)")
    own.add_argument("--activation-wait", type=float, default=DEFAULT_ACTIVATION_WAIT_S,
                     help="seconds to keep retrying a refused activation (default "
                          f"{DEFAULT_ACTIVATION_WAIT_S:.0f})")
    own.add_argument("--flower-supernode", default="flower-supernode",
                     help="the flower-supernode executable (default: found on PATH)")
    args, rest = own.parse_known_args(argv)
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--superlink", default="127.0.0.1:9092")
    peek.add_argument("--insecure", action="store_true")
    peek.add_argument("--root-certificates", default=None)
    peek.add_argument("--auth-supernode-private-key", default=None)
    seen, _ = peek.parse_known_args(rest)
    node = SuperNodeArgs(seen.superlink, seen.insecure, seen.root_certificates,
                         seen.auth_supernode_private_key)
    if args.state_file is None:
        home = Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
        args.state_file = home / "fmtl-supernode.json"
    return args, rest, node


# ----------------------------------------------------------------------------- keys and ids

def public_key_line(private_key: str) -> str:
    """The OpenSSH public key line of the private key file ``private_key``."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_ssh_private_key(Path(private_key).expanduser().read_bytes(),
                                             None)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                          serialization.PublicFormat.OpenSSH).decode()


def read_node_id(state_file: Path, node: SuperNodeArgs) -> int | None:
    """The node id recorded for this SuperLink and key, or None."""
    try:
        record = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return None
    if record.get("superlink") != node.superlink or \
            record.get("public_key") != _key_or_none(node):
        return None
    node_id = record.get("node_id")
    return node_id if isinstance(node_id, int) else None


def write_node_id(state_file: Path, node: SuperNodeArgs, node_id: int) -> None:
    """Record ``node_id`` for this SuperLink and key (written to a temporary file first)."""
    record = {"superlink": node.superlink, "public_key": _key_or_none(node),
              "node_id": node_id}
    try:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = state_file.with_name(state_file.name + ".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(state_file)
    except OSError as err:
        say(f"cannot record the node id in {state_file}: {err}")


def _key_or_none(node: SuperNodeArgs) -> str | None:
    if node.private_key is None:
        return None
    try:
        return public_key_line(node.private_key)
    except (OSError, ValueError):
        return None


def release_node_id(node: SuperNodeArgs, node_id: int) -> str:
    """Ask the SuperLink to deactivate ``node_id`` (Fleet API, signed with the node's key).

    Returns ``"released"``, ``"not online"`` (the SuperLink had already let it go),
    ``"not ours"`` (401: the key is not registered under that id) or a short reason why
    the request could not be made.
    """
    if node.private_key is None:
        return "no key (without node authentication every start is a new node)"
    try:
        import httpx
        from cryptography.hazmat.primitives import serialization
        from flwr.proto.fleet_pb2 import DeactivateNodeRequest
        from flwr.supernode.fleet_http_client import FleetHttpClient
        from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor
    except ImportError as err:  # another flwr than 1.42's HTTP Fleet client
        return f"this flwr has no HTTP Fleet client ({err})"
    key = serialization.load_ssh_private_key(
        Path(node.private_key).expanduser().read_bytes(), None)
    roots = None if node.insecure else node.root_certificates
    try:
        with FleetHttpClient.from_server_address(
                node.superlink, node.insecure, roots,
                interceptors=[NodeAuthHttpInterceptor(key, key.public_key())]) as client:
            client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))
    except httpx.HTTPStatusError as err:
        code = err.response.status_code
        return {401: "not ours", 412: "not online"}.get(code, f"HTTP {code}")
    except (httpx.HTTPError, OSError, ValueError) as err:
        return f"request failed: {err}"
    return "released"


# ----------------------------------------------------------------------------- orphans

def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, from /proc (Linux; empty elsewhere)."""
    out: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def clientapp_descendants(pid: int) -> set[int]:
    """The ``flwr-clientapp`` processes below ``pid`` (by /proc, never by name alone)."""
    children = _children_by_parent()
    found, todo = set(), list(children.get(pid, []))
    while todo:
        child = todo.pop()
        todo.extend(children.get(child, []))
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(Path(arg.decode(errors="replace")).name == "flwr-clientapp"
               for arg in argv[:2]):
            found.add(child)
    return found


class OrphanReaper:
    """Stops the ``flwr-clientapp`` started for a message flower-supernode gave up.

    flwr 1.41/1.42's SuperNode, pulling a message's objects from the SuperLink, gets a
    ``RunNotRunningException`` when the run stopped meanwhile (e.g. its ServerApp crashed).
    That exception is a ``BaseException``, so the cleanup under ``except Exception`` in
    ``flwr/supernode/start_client_internal.py::_pull_and_store_message`` is skipped: the
    outer handler logs "Run ID R is not in `RUNNING` status. Ignoring message M" and returns,
    leaving the message's task pending and its objects preregistered but empty. SuperExec
    then starts a ``flwr-clientapp`` for that task, which waits for objects that never come
    (``flwr/supercore/inflatable/inflatable_utils.py::pull_objects``: 500 tries of up to 10 s,
    at most ``PULL_MAX_TIME`` = 7200 s), before any ClientApp code of ours runs.

    The SuperNode handles one message at a time: it logs "Receiving: ..." when it pulls one,
    creates its task at once (SuperExec may start its ``flwr-clientapp`` while the content is
    still being pulled) and waits for the reply before it pulls the next. So the
    ``flwr-clientapp`` of the message a "Ignoring message" line gives up is one that appeared
    after the last "Receiving:" line, or appears before the next one (SuperExec claims the
    oldest pending task first); one that was there before that "Receiving:" line served an
    earlier message and is left alone. The orphan gets SIGTERM (its exit handler reports the
    task failed), SIGKILL 10 s later.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ignored = False  # the current message was given up (until the next "Receiving:")
        self.known: set[int] = set()
        self.since_receiving: set[int] = set()  # appeared since the last "Receiving:"
        self.reaped: list[int] = []

    def note(self, line: str) -> None:
        """Follow flower-supernode's output."""
        if IGNORED.search(line):
            with self.lock:
                self.ignored = True
        elif RECEIVING in line:
            with self.lock:
                self.ignored = False
                self.since_receiving = set()

    def look(self, supernode_pid: int) -> list[int]:
        """Reap the ``flwr-clientapp`` processes of the current message if it was given up."""
        current = clientapp_descendants(supernode_pid)
        with self.lock:
            self.since_receiving |= current - self.known
            self.since_receiving &= current
            self.known = current
            orphans = sorted(self.since_receiving) if self.ignored else []
            self.since_receiving -= set(orphans)
        for pid in orphans:
            say(f"stopping flwr-clientapp {pid}: started for a message of a run that is "
                "no longer RUNNING, it would wait up to 2 h for the message's content")
            _terminate(pid)
            self.reaped.append(pid)
        return orphans

    def watch(self, child: subprocess.Popen, stop: threading.Event) -> None:
        """Look every :data:`REAP_POLL_S` s while ``child`` runs."""
        while not stop.wait(REAP_POLL_S) and child.poll() is None:
            self.look(child.pid)


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return

    def finish() -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.2)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    threading.Thread(target=finish, daemon=True).start()


# ----------------------------------------------------------------------------- the child

@dataclass
class Attempt:
    """What one ``flower-supernode`` process did."""

    returncode: int
    node_id: int | None = None
    refused: bool = False
    unauthorized: bool = False
    signalled: bool = False


class Launcher:
    """Runs ``flower-supernode`` until it ends for a reason other than a refused activation."""

    def __init__(self, args: argparse.Namespace, rest: list[str], node: SuperNodeArgs):
        self.args, self.rest, self.node = args, rest, node
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.reaper = OrphanReaper()

    def on_signal(self, signum: int, _frame: object) -> None:
        """Stop retrying; pass the signal on to the running ``flower-supernode``."""
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run_once(self) -> Attempt:
        """Start ``flower-supernode``, pass its output through, note what it says.

        The output is read by a thread: the SuperExec that ``flower-supernode`` starts
        inherits the pipe and may outlive it, so the end of the output is not the end of
        the process. Waiting for (and so reaping) ``flower-supernode`` also lets that
        SuperExec, which watches its parent's PID, notice and exit.
        """
        exe = shutil.which(self.args.flower_supernode) or self.args.flower_supernode
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.child = subprocess.Popen([exe, *self.rest], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      text=True, errors="replace", bufsize=1)
        attempt = Attempt(returncode=0)
        reader = threading.Thread(target=self._pump, args=(self.child.stdout, attempt),
                                  daemon=True)
        reader.start()
        stop_watch = threading.Event()
        watcher = threading.Thread(target=self.reaper.watch, args=(self.child, stop_watch),
                                   daemon=True)
        watcher.start()
        attempt.returncode = self.child.wait()
        stop_watch.set()
        reader.join(timeout=OUTPUT_GRACE_S)
        attempt.signalled = self.stopping
        return attempt

    def _pump(self, stream: IO[str], attempt: Attempt) -> None:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            self._note(attempt, line)

    def _note(self, attempt: Attempt, line: str) -> None:
        self.reaper.note(line)
        if attempt.node_id is None and (match := ACTIVATED.search(line)):
            attempt.node_id = int(match.group(1))
            write_node_id(self.args.state_file, self.node, attempt.node_id)
        elif REFUSED in line and attempt.node_id is None:
            attempt.refused = True
        elif UNAUTHORIZED in line and attempt.node_id is not None:
            attempt.unauthorized = True

    def run(self) -> int:
        """Attempts until one is activated (or the wait runs out); the exit status."""
        first_refusal: float | None = None
        pauses = 0
        released = False  # once: a release that did not help is not repeated in a loop
        while True:
            attempt = self.run_once()
            if attempt.signalled or not attempt.refused:
                return self.finish(attempt)
            first_refusal = first_refusal or time.monotonic()
            if not released and self.try_release():
                released = True
                continue
            waited = time.monotonic() - first_refusal
            if waited >= self.args.activation_wait:
                say(not_activated_hint(self.node, waited))
                return EXIT_NOT_ACTIVATED
            pause = BACKOFF_S[min(pauses, len(BACKOFF_S) - 1)]
            pauses += 1
            say(f"activation refused (its old node id may still count as online for up to "
                f"60 s after a crash); trying again in {pause:.0f} s")
            if self.sleep(pause):
                return 0

    def try_release(self) -> bool:
        """Release the recorded node id; True if the SuperLink let it go (retry at once)."""
        node_id = read_node_id(self.args.state_file, self.node)
        if node_id is None:
            return False
        outcome = release_node_id(self.node, node_id)
        say(f"releasing the old node id {node_id}: {outcome}")
        return outcome == "released"

    def sleep(self, seconds: float) -> bool:
        """Sleep unless a signal arrives; True if one did."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
        return self.stopping

    def finish(self, attempt: Attempt) -> int:
        """The exit status of an attempt that ended for a reason other than a refusal."""
        if not attempt.signalled and self.forgotten(attempt):
            say(unauthorized_hint(self.node, attempt.node_id))
            return EXIT_UNAUTHORIZED
        return attempt.returncode

    def forgotten(self, attempt: Attempt) -> bool:
        """Whether the SuperLink stopped recognising the activated node: a 401 in the output,
        or an exit 0 we did not ask for after which the SuperLink answers the node's own id
        with 401 (flower-supernode meets a 401 by sending itself SIGINT, in
        ``flwr/supercore/retry/http_retry.py`` and its heartbeat, and usually logs nothing
        but "SuperNode terminated gracefully.")."""
        if attempt.node_id is None:
            return False
        if attempt.unauthorized:
            return True
        return attempt.returncode == 0 and \
            release_node_id(self.node, attempt.node_id) == "not ours"


# ----------------------------------------------------------------------------- hints

def _register_command(node: SuperNodeArgs) -> str:
    if node.private_key is None:
        return ("the SuperLink forgot this SuperNode; it registers itself again when "
                "restarted (no node authentication)")
    pub = f"{node.private_key}.pub"
    try:
        line = public_key_line(node.private_key)
    except (OSError, ValueError) as err:
        line = f"(cannot read {node.private_key}: {err})"
    return (f"on the server, register this device's public key again:\n"
            f"    flwr supernode register {pub} <connection>\n"
            f"  where {pub} holds\n    {line}\n"
            f"  (deploy/README.md, section 3); then restart this SuperNode")


def not_activated_hint(node: SuperNodeArgs, waited: float) -> str:
    """The message of exit status 2."""
    return (f"activation still refused after {waited:.0f} s ([code: 2004]): the SuperLink "
            f"does not know this key (never registered, unregistered, or the SuperLink "
            f"lost its database).\n  {_register_command(node)}")


def unauthorized_hint(node: SuperNodeArgs, node_id: int | None) -> str:
    """The message of exit status 3."""
    return (f"the SuperLink no longer recognises node {node_id} (401 Unauthorized): it lost "
            f"its database or the node was unregistered.\n  {_register_command(node)}")


def say(text: str) -> None:
    """A line of the launcher's own on stdout (beside flower-supernode's output)."""
    print(f"fmtl-supernode: {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fmtl-supernode``."""
    args, rest, node = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(args, rest, node)
    signal.signal(signal.SIGTERM, launcher.on_signal)
    signal.signal(signal.SIGINT, launcher.on_signal)
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
