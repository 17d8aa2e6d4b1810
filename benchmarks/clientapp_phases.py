"""``flwr-clientapp`` with the CPU seconds of each phase of its one message recorded.

``loopback_rounds.py --phases`` puts this script first on the SuperNodes' ``PATH`` under the
name ``flwr-clientapp`` (a SuperExec starts ClientApp processes by that name). It runs Flower's
own ``flwr-clientapp`` entry point, timing (``time.process_time``) the functions of
``flwr.supernode.runtime.run_clientapp`` that make up a message, and at exit writes
``$FMTL_PHASES_DIR/cpu-<pid>.json``:

``startup`` (interpreter start to this script's first line), ``import_flwr_runtime``,
``pull_task_input`` (the message, its context and the FAB from the SuperNode),
``install_from_fab`` (unzip and hash the FAB: every message), ``load_app`` (import the app),
``app_call`` (the ClientApp's handler), ``push_message``, ``push_task_output`` and ``total``
(the process's CPU seconds at exit).
"""

import atexit
import json
import os
import sys
import time

cpu = time.process_time
phases = {"startup": cpu()}

import flwr.supernode.runtime.run_clientapp as runtime  # noqa: E402

phases["import_flwr_runtime"] = cpu() - phases["startup"]


def timed(name, func):
    """``func``, adding its CPU seconds to ``phases[name]``."""
    def wrapper(*args, **kwargs):
        started = cpu()
        try:
            return func(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + cpu() - started
    return wrapper


for _name in ("pull_task_input", "install_from_fab", "push_message", "push_task_output"):
    setattr(runtime, _name, timed(_name, getattr(runtime, _name)))
_get_load_client_app_fn = runtime.get_load_client_app_fn


def get_load_client_app_fn(*args, **kwargs):
    """Flower's app loader, whose app's calls are timed too."""
    load = _get_load_client_app_fn(*args, **kwargs)

    def load_timed(*load_args, **load_kwargs):
        return timed("app_call", timed("load_app", load)(*load_args, **load_kwargs))
    return load_timed


runtime.get_load_client_app_fn = get_load_client_app_fn


@atexit.register
def _write() -> None:
    phases["total"] = cpu()
    path = os.path.join(os.environ["FMTL_PHASES_DIR"], f"cpu-{os.getpid()}.json")
    with open(path, "w") as handle:
        json.dump(phases, handle)


if __name__ == "__main__":
    from flwr.supernode.cli import flwr_clientapp

    sys.argv[0] = "flwr-clientapp"
    sys.exit(flwr_clientapp())
