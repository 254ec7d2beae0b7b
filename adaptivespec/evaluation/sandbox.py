"""Run untrusted Python (model-written code) in a separate, limited process.

This is a guard against accidents (infinite loops, crashes, runaway memory, stray network use), not
a security boundary: the program runs as the current user. What it gets:

* a fresh interpreter, ``sys.executable -I`` (isolated: no user site, no ``PYTHON*`` variables),
  in a new session, with ``cwd``, ``HOME`` and ``TMPDIR`` set to a temporary directory that is
  removed afterwards, ``stdin`` closed, and proxy variables emptied;
* a wall-clock limit (the whole process group is killed with SIGKILL when it runs over), and where
  :mod:`resource` exists, limits on address space, CPU seconds and written file size;
* ``socket`` connections refused (``connect``/``getaddrinfo`` raise :class:`OSError`).

Success means the program ran to the end: exit status 0 *and* a random end marker printed after
the program's last statement, so an early ``sys.exit(0)`` does not count as a pass.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

_PRELUDE = r"""
import os, runpy, socket, sys
def _limit(name, value):
    try:
        import resource
        kind = getattr(resource, name)
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, hard))
    except Exception:
        pass
_limit("RLIMIT_AS", int(os.environ["ASPEC_MEMORY_BYTES"]))
_limit("RLIMIT_CPU", int(os.environ["ASPEC_CPU_SECONDS"]))
_limit("RLIMIT_FSIZE", 16 * 1024 * 1024)
def _refuse(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
socket.socket.connect = socket.socket.connect_ex = _refuse
socket.getaddrinfo = socket.create_connection = _refuse
_marker = os.environ.pop("ASPEC_END_MARKER")
del _limit, _refuse
runpy.run_path(sys.argv[1], run_name="__main__")
sys.stdout.flush()
print("\n" + _marker, flush=True)
"""

_TAIL = 4000


@attrs.frozen(kw_only=True)
class RunResult:
    """Outcome of one sandboxed run."""

    ok: bool
    """The program ran to its end with exit status 0."""
    returncode: int | None
    """Exit status (negative: killed by that signal); ``None`` when it timed out."""
    timed_out: bool
    """Killed for running past the wall-clock limit."""
    stderr: str
    """Last few thousand characters of standard error."""

    @property
    def reason(self) -> str:
        """One-line explanation: ``passed``, ``timed out``, or the last line of the error."""
        if self.ok:
            return "passed"
        if self.timed_out:
            return "timed out"
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()[:300]
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        if self.returncode == 0:
            return "exited before the end of the program"
        return f"exit status {self.returncode}"


def _environment(workdir: str, memory_mb: int, timeout: float, marker: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
        "ASPEC_MEMORY_BYTES": str(memory_mb * 1024 * 1024),
        "ASPEC_CPU_SECONDS": str(int(timeout) + 1),
        "ASPEC_END_MARKER": marker,
        "no_proxy": "*",
        "NO_PROXY": "*",
    }
    for key in ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy"):
        env[key] = env[key.upper()] = ""
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        proc.kill()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - _TAIL))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_python(source: str, *, timeout: float = 10.0, memory_mb: int = 1024) -> RunResult:
    """Run ``source`` as ``__main__`` in a sandboxed interpreter; never raises for its failures."""
    marker = f"ASPEC-END-{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="adaptivespec-run-") as workdir:
        work = Path(workdir)
        (work / "program.py").write_text(source, encoding="utf-8")
        out_path, err_path = work / "stdout.txt", work / "stderr.txt"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _PRELUDE, "program.py"],
                cwd=workdir,
                env=_environment(workdir, memory_mb, timeout, marker),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            try:
                returncode: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                _kill_group(proc)  # also ends children the program left behind
                proc.wait()
        finished = returncode == 0 and marker in _tail(out_path)
        return RunResult(
            ok=finished, returncode=returncode, timed_out=returncode is None, stderr=_tail(err_path)
        )
