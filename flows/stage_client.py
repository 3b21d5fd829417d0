"""The stage server's client: `scripts/py -m MODULE ARGS` runs this when $RR_STAGE_SERVER names a
live stage server (flows/stage_server.py), so the stage runs in a child forked from a process that
has already imported the stages' libraries.

    python -I flows/stage_client.py -m flows.tokenize          # what scripts/py execs

It hands the server its argv, working directory, environment and its own stdin/stdout/stderr (as
file descriptors), forwards SIGINT/SIGTERM/SIGHUP to the stage's process and exits with the stage's
status, so DVC (or a shell) sees the same process contract as `python -m MODULE ARGS`. Whenever the
server cannot run the stage (gone, refused: e.g. the environment differs from the one its imports
read), the same command runs in this process's place as a cold `python -m`.

Standard library only, started with `-I`: the client's own start must stay a few tens of ms.
"""

import json
import os
import signal
import socket
import sys
import time

ENV_SERVER = "RR_STAGE_SERVER"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EARLY_SIGNAL_GRACE_S = 2.0  # how long a signal that came before the stage's pid waits for it


def run_cold(argv: list[str], why: str | None) -> None:
    """`python ARGV` in this process's place (what scripts/py would have exec'd)."""
    if why:
        print(f"stage server: {why}; running `python {' '.join(argv[:2])}` cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *argv])


def _end_by(signum: int) -> None:
    """Die by `signum` at its default action, as `python -m` would have."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # only if the default action did not end the process


def _read_line(sock: socket.socket, buf: bytearray, give_up=None) -> dict | None:
    """The next newline-terminated JSON message, or None when the server closed the connection. On a
    socket with a timeout, `give_up()` is asked at each one; TimeoutError when it says so."""
    while b"\n" not in buf:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            if give_up is not None and give_up():
                raise
            continue
        if not chunk:
            return None
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def main(argv: list[str]) -> None:
    path = os.environ.get(ENV_SERVER, "")
    if len(argv) < 2 or argv[0] != "-m":
        run_cold(argv, "only `-m MODULE` commands are served")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:  # not up yet (its imports take a while), gone, or never started
        run_cold(argv, "not ready yet" if not os.path.exists(path) else f"cannot connect to {path} ({e.strerror or e})")
    ignored = [int(sig) for sig in FORWARDED if signal.getsignal(sig) is signal.SIG_IGN]  # nohup, `cmd &`
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "ignored_signals": ignored}).encode()
    # The stage starts (and may print) before its pid reaches us. A signal in between is kept and
    # forwarded once the pid arrives; if the server does not answer within EARLY_SIGNAL_GRACE_S of it, the
    # request is dropped (the server takes down a stage whose client left) and the signal ends us.
    handled = [sig for sig in FORWARDED if int(sig) not in ignored]
    early: list[tuple[int, float]] = []  # (signal, when), before the pid
    for sig in handled:
        signal.signal(sig, lambda signum, _frame: early.append((signum, time.monotonic())))
    socket.send_fds(sock, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    buf = bytearray()
    sock.settimeout(0.1)
    try:
        reply = _read_line(sock, buf, give_up=lambda: bool(early) and time.monotonic() - early[0][1] > EARLY_SIGNAL_GRACE_S)
    except TimeoutError:
        sock.close()
        _end_by(early[0][0])
    sock.settimeout(None)
    if reply is None or "refused" in reply:
        sock.close()
        if early:  # signalled before anything ran: end as a cold run signalled then would
            _end_by(early[0][0])
        run_cold(argv, reply["refused"] if reply else "the server closed the connection")
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in handled:
        signal.signal(sig, forward)
    for signum, _ in early:  # read after `forward` is in place, so none is missed
        forward(signum, None)
    done = _read_line(sock, buf)
    if done is None:  # the server died under a running stage: do not leave the stage running unowned
        forward(signal.SIGTERM, None)
        print(f"stage server: the server exited while stage process {pid} ran", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(done["exit"])


if __name__ == "__main__":
    main(sys.argv[1:])
