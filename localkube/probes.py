"""Running one probe or lifecycle hook action: ``httpGet``, ``tcpSocket`` or ``exec``.

``httpGet`` succeeds on a status in [200, 400); its host defaults to the pod IP and named ports resolve through
the container's ports. ``exec`` runs the command as a local process with the container's environment; exit code 0
succeeds. Every action is bounded by its timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Result:
    ok: bool
    message: str = ""


def resolve_port(port, container: dict) -> int | None:
    if isinstance(port, int):
        return port
    if isinstance(port, str):
        if port.isdigit():
            return int(port)
        for item in container.get("ports") or []:
            if item.get("name") == port:
                return item.get("containerPort")
    return None


async def wait_process(proc: subprocess.Popen) -> int:
    """Wait for a child without blocking the loop (pidfd when the kernel has it, a thread otherwise)."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return await loop.run_in_executor(None, proc.wait)
    done = loop.create_future()

    def ready() -> None:
        loop.remove_reader(fd)
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def run_action(
    action: dict,
    container: dict,
    pod_ip: str,
    env: dict[str, str],
    timeout: float,
    session: aiohttp.ClientSession,
    cwd: str | None = None,
) -> Result:
    if action.get("httpGet") is not None:
        return await _http_get(action["httpGet"], container, pod_ip, timeout, session)
    if action.get("tcpSocket") is not None:
        return await _tcp(action["tcpSocket"], container, pod_ip, timeout)
    if action.get("exec") is not None:
        return await _exec(action["exec"].get("command") or [], env, timeout, cwd)
    if action.get("sleep") is not None:
        await asyncio.sleep(min(float(action["sleep"].get("seconds", 0)), timeout))
        return Result(True)
    return Result(False, "localkube supports httpGet, tcpSocket and exec actions only")


async def _http_get(spec: dict, container: dict, pod_ip: str, timeout: float, session: aiohttp.ClientSession) -> Result:
    port = resolve_port(spec.get("port"), container)
    if port is None:
        return Result(False, f"unknown port {spec.get('port')!r}")
    host = spec.get("host") or pod_ip
    scheme = (spec.get("scheme") or "HTTP").lower()
    path = spec.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    url = f"{scheme}://{host}:{port}{path}"
    headers = {h["name"]: h.get("value", "") for h in spec.get("httpHeaders") or [] if h.get("name")}
    headers.setdefault("User-Agent", "kube-probe/1.37")
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout), ssl=False, allow_redirects=False
        ) as response:
            body = (await response.content.read(1024)).decode("utf-8", "replace")
            if 200 <= response.status < 400:
                return Result(True)
            return Result(False, f"HTTP probe failed with statuscode: {response.status}" + (f" {body}" if body else ""))
    except TimeoutError:
        return Result(False, f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)')
    except (aiohttp.ClientError, OSError) as exc:
        return Result(False, f'Get "{url}": {exc}')


async def _tcp(spec: dict, container: dict, pod_ip: str, timeout: float) -> Result:
    port = resolve_port(spec.get("port"), container)
    if port is None:
        return Result(False, f"unknown port {spec.get('port')!r}")
    host = spec.get("host") or pod_ip
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError) as exc:
        return Result(False, f"dial tcp {host}:{port}: {exc or 'i/o timeout'}")
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return Result(True)


async def _exec(command: list[str], env: dict[str, str], timeout: float, cwd: str | None) -> Result:
    if not command:
        return Result(False, "exec action has no command")
    with tempfile.TemporaryFile() as output:
        try:
            proc = subprocess.Popen(
                [str(c) for c in command],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return Result(False, f"exec failed: {exc}")
        try:
            code = await asyncio.wait_for(wait_process(proc), timeout)
        except TimeoutError:
            kill_group(proc.pid, signal.SIGKILL)
            await wait_process(proc)
            return Result(False, f"command {command!r} timed out after {timeout:g}s")
        output.seek(0)
        text = output.read(4096).decode("utf-8", "replace").strip()
    if code == 0:
        return Result(True, text)
    return Result(False, f"command {command!r} exited with {code}: {text}")
