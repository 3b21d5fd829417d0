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

ENV_SERVER = "RR_STAGE_SERVER"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_cold(argv: list[str], why: str | None) -> None:
    """`python ARGV` in this process's place (what scripts/py would have exec'd)."""
    if why:
        print(f"stage server: {why}; running `python {' '.join(argv[:2])}` cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *argv])


def _read_line(sock: socket.socket, buf: bytearray) -> dict | None:
    """The next newline-terminated JSON message, or None when the server closed the connection."""
    while b"\n" not in buf:
        chunk = sock.recv(4096)
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
    # The stage starts (and may print) before its pid reaches us: a signal sent in between stays pending
    # until `forward` is installed, instead of killing this client and leaving the stage to the server.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    socket.send_fds(sock, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    buf = bytearray()
    reply = _read_line(sock, buf)
    if reply is None or "refused" in reply:
        sock.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending signal ends us here, as it would a cold run
        run_cold(argv, reply["refused"] if reply else "the server closed the connection")
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        if int(sig) not in ignored:
            signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # delivers, and so forwards, what arrived meanwhile
    done = _read_line(sock, buf)
    if done is None:  # the server died under a running stage: do not leave the stage running unowned
        forward(signal.SIGTERM, None)
        print(f"stage server: the server exited while stage process {pid} ran", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(done["exit"])


if __name__ == "__main__":
    main(sys.argv[1:])
