"""Process helpers of the end-to-end tests: free ports, and stopping what a test started by PID."""

from __future__ import annotations

import signal
import socket

import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_processes(procs: list[psutil.Process], grace: float = 10.0) -> list[int]:
    """SIGTERM ``procs`` (in order), wait ``grace`` s, SIGKILL what is left; surviving PIDs."""
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return [p.pid for p in alive]
