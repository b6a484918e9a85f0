"""`llmfleet up`: the local fleet behind `make demo`.

Pulls the bundled model, starts localkube, Prometheus, the operator and the gateway (`LocalFleet`), applies the
SmolLM2 example, shows the pods until one is Ready, streams a real answer through the gateway, prints
`GATEWAY_URL=`, `API_KEY=` and `KUBECONFIG=` lines (for scripts) and the URLs, optionally drives the `--scenario`
tour, and keeps running until Ctrl-C or SIGTERM, then stops everything it started.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from types import FrameType

import typer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = REPO / "examples" / "smollm2-cpu.yaml"
DEFAULT_PROMPT = "What is the capital of France?"


class _Stop(Exception):
    """SIGTERM arrived: leave like on Ctrl-C."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _Stop()


def up_command(
    scenario: bool = typer.Option(False, help="Also drive the scripted tour (autoscaling, canary, rollback)."),
    work_dir: Path = typer.Option(Path(".llmfleet-local"), help="Folder for logs, kubeconfig and state."),
    manifest: Path = typer.Option(DEFAULT_MANIFEST, help="InferenceDeployment YAML to apply."),
    prompt: str = typer.Option(DEFAULT_PROMPT, help="The question streamed through the gateway once Ready."),
    prometheus: bool = typer.Option(True, help="Run Prometheus (when on PATH) for autoscaling and analysis."),
    ready_timeout: float = typer.Option(600.0, min=1, help="Longest wait in seconds for the first Ready pod."),
    exit_when_ready: bool = typer.Option(
        False, "--exit", help="Stop once the answer (and the tour) is done instead of running until Ctrl-C."
    ),
) -> None:
    """Start the local fleet."""
    from rich.console import Console

    from llmfleet.kube import load_manifests

    console = Console(stderr=True, highlight=False)
    try:
        docs = load_manifests(manifest)
    except (OSError, ValueError) as error:
        console.print(f"[red]llmfleet up[/]: cannot read {manifest}: {error}")
        raise typer.Exit(2) from None
    deployment = next((d for d in docs if d["kind"] == "InferenceDeployment"), None)
    if deployment is None:
        console.print(f"[red]llmfleet up[/]: {manifest} holds no InferenceDeployment")
        raise typer.Exit(2)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = _up(
            console, deployment, manifest, work_dir, prompt, prometheus, ready_timeout, scenario, exit_when_ready
        )
    except (KeyboardInterrupt, _Stop):
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    raise typer.Exit(code)


def _pull(console, source: str) -> bool:
    """`llmfleet model pull` the bundled model the manifest names (a spinner meanwhile); False on failure."""
    from llmfleet.localfleet import llmfleet_argv

    if not source.startswith("bundled://"):
        console.print(f"model {source}: not bundled, the workers fetch it themselves")
        return True
    name = source.removeprefix("bundled://")
    started = time.monotonic()
    proc = subprocess.Popen(
        llmfleet_argv("model", "pull", name),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        with console.status(f"llmfleet model pull {name} (converting the bundled GGUF once; later runs are instant)"):
            output, _ = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        console.print(f"[red]llmfleet model pull {name} failed[/]:\n{output[-3000:]}")
        return False
    console.print(
        f"[green]✓[/] model {name} ready at {output.strip().splitlines()[-1]} ({time.monotonic() - started:.1f} s)",
        soft_wrap=True,
    )
    return True


def _up(
    console,
    deployment: dict,
    manifest: Path,
    work_dir: Path,
    prompt: str,
    prometheus: bool,
    ready_timeout: float,
    scenario: bool,
    exit_when_ready: bool,
) -> int:
    from llmfleet.localfleet import FleetSettings, LocalFleet
    from llmfleet.processes import ProcessError
    from llmfleet.progress import deployment_ready, watch_until
    from llmfleet.scenario import TourContext, run_tour
    from llmfleet.traffic import ChatError, stream_chat

    spec = deployment.get("spec") or {}
    name = deployment["metadata"]["name"]
    model = (spec.get("model") or {}).get("name", name)
    if not _pull(console, (spec.get("model") or {}).get("source", "")):
        return 1
    fleet = LocalFleet(
        FleetSettings(work_dir=work_dir, prometheus=prometheus),
        report=lambda line: console.print(f"[green]✓[/] {line}"),
    )
    try:
        with console.status("starting localkube, Prometheus, the operator and the gateway"):
            fleet.start()
        kube = fleet.kube
        assert kube is not None  # start() connected it
        namespace = deployment["metadata"].get("namespace") or fleet.settings.namespace
        fleet.ensure_namespace(namespace)
        fleet.apply_file(manifest, namespace)
        console.print(f"[green]✓[/] applied {manifest} (InferenceDeployment {namespace}/{name})", soft_wrap=True)
        ok, took = watch_until(
            console, kube, name, namespace, lambda r, _p: deployment_ready(r), ready_timeout, check=fleet.check_running
        )
        if not ok:
            console.print(f"[red]no Ready pod within {ready_timeout:.0f} s[/]")
            for pod in kube.pods(name, namespace):
                console.print(
                    f"--- log of {pod['metadata']['name']}:\n{kube.pod_log(pod['metadata']['name'], namespace)}"
                )
            console.print(f"--- operator log:\n{fleet.operator.log_tail() if fleet.operator else ''}")
            return 1
        console.print(f"\n[green]✓[/] {name} is Ready after {took:.1f} s")
        console.print(f"\n[bold]> {prompt}[/]")
        started = time.monotonic()
        try:
            for piece in stream_chat(fleet.gateway_url, fleet.api_key, model, prompt):
                console.print(piece, end="", soft_wrap=True)
        except (ChatError, OSError) as error:
            console.print(f"\n[red]the chat through the gateway failed[/]: {error}")
            return 1
        console.print(f"\n[dim](streamed through the gateway in {time.monotonic() - started:.1f} s)[/]\n")
        for line in (f"GATEWAY_URL={fleet.gateway_url}", f"API_KEY={fleet.api_key}", f"KUBECONFIG={fleet.kubeconfig}"):
            print(line, flush=True)
        for what, url in fleet.urls().items():
            console.print(f"  {what:<11} {url}")
        console.print(f"  logs        {fleet.logs}")
        console.print(
            f"\n  export KUBECONFIG={fleet.kubeconfig}; kubectl get infd,pods\n"
            f"  curl -N {fleet.gateway_url}/v1/chat/completions -H 'Authorization: Bearer {fleet.api_key}'"
            f' -H \'Content-Type: application/json\' -d \'{{"model": "{model}", "stream": true, '
            f'"messages": [{{"role": "user", "content": "Hi"}}]}}\'',
            soft_wrap=True,
        )
        if scenario:
            results = run_tour(
                TourContext(
                    console, kube, fleet.gateway_url, fleet.api_key, namespace, name, model, manifest.resolve().parent
                )
            )
            console.rule("scenario summary")
            for title, outcome in results:
                console.print(f"  {title}: {outcome}")
        if exit_when_ready:
            return 0
        console.print("\n[bold]the fleet is running; Ctrl-C stops it[/]")
        while True:
            fleet.check_running()
            time.sleep(2)
    except ProcessError as error:
        console.print(f"[red]llmfleet up[/]: {error}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with console.status("stopping the gateway, the operator, Prometheus and localkube (with its pods)"):
            fleet.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        console.print("stopped everything llmfleet up started")
