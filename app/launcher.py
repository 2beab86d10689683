"""`python -m app start [--model PATH] [--detach] [engine flags…] | stop | status`

start: resolve the model, start `python -m proxy` (proxy.log) so the page is there at once, then
`python -m engine` (output in vllm.log, echoed here while it loads; its load progress goes to a status file the
proxy reads for the page's "Loading model… N%"), wait for its /health, print the URL, then supervise: an engine
that exits is restarted with back-off while the proxy keeps serving the page (app/supervision.py); if the proxy
exits, stop the engine and say why. Ctrl-C, SIGTERM or `python -m app stop` stop both (engine first, then proxy).
Ports come from ENGINE_PORT (3001) and PROXY_PORT (8000); see app/settings.py for the rest.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from app import control, procs
from app import hub
from app.checkpoints import gpu_memory, gpu_memory_used
from app.fit import fit_for_launch
from app.supervision import EngineStatusFile, EngineWatch, RestartPolicy
from app.models import TARGET_NAME, ModelNotFound, ResolvedModel, resolve_model
from app.settings import REPO, Settings
from engine import load_progress
from engine.args import EngineArgs
from engine.server.cli import PROXY_KEY_ENV, ServerArgs

POLL_S = 0.3


class StopRequested(Exception):
    pass


def _raise_stop(signum, _frame):
    raise StopRequested(signal.Signals(signum).name)


def say(msg: str = "") -> None:
    print(f"[app] {msg}" if msg else "", flush=True)


def split_engine_args(args: list[str]) -> tuple[list[str], str | None]:
    """Engine flags without --api-key (its value is handed over by environment, not shown in `ps`)."""
    out, key, i = [], None, 0
    while i < len(args):
        if args[i] == "--api-key" and i + 1 < len(args):
            key, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--api-key="):
            key = args[i].split("=", 1)[1]
        else:
            out.append(args[i])
        i += 1
    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in out):
            raise SystemExit(f"[app] set the engine's address with ENGINE_HOST / ENGINE_PORT, not {flag}")
    return out, key


def tensor_parallel_size(args: list[str]) -> int:
    """The engine's --tensor-parallel-size / -tp among the launcher's arguments (1 when absent; a bad value is
    the engine's to refuse)."""
    for i, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            value = args[i + 1] if arg == flag and i + 1 < len(args) else \
                arg.split("=", 1)[1] if arg.startswith(flag + "=") else None
            if value is not None:
                return int(value) if value.isdigit() and int(value) > 0 else 1
    return 1


def fit_engine_flags(model: ResolvedModel, engine_args: list[str], env=os.environ, gpu=gpu_memory,
                     used=gpu_memory_used) -> tuple[ResolvedModel, list[str]]:
    """The engine flags fitted to the GPU (app/fit.py) go before the user's, so that a flag the user gave wins
    in the engine's parser as well; what was chosen and why joins the model's notes, printed at start."""
    plan = None if model.demo else fit_for_launch(model.path, engine_args, env, gpu, used)
    if plan is None:
        return model, engine_args
    return replace(model, notes=model.notes + tuple(plan.lines())), plan.args() + engine_args


DEMO_GENERATION_DIR = Path(__file__).resolve().parent / "demo_generation"


def load_status_file(s: Settings) -> Path:
    """Where the engine reports its start-up progress (--load-status-file) and the proxy reads it."""
    return s.run_dir / "engine-load.json"


# On the CPU each step runs on the engine's own thread, so reading a step's tokens before scheduling the next (what
# drafting needs) costs nothing: n-gram drafts speed up answers that repeat their context and cost next to nothing
# otherwise (BENCHMARKS.md, "Speculative decoding"). On a GPU speculation stays the user's choice.
CPU_SPECULATIVE_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4}'


def engine_command(s: Settings, model: ResolvedModel, extra: list[str], env=os.environ) -> list[str]:
    cmd = [s.python, "-m", "engine", "--model", str(model.path), "--host", s.engine_host,
           "--port", str(s.engine_port)]
    if not any(a.startswith("--served-model-name") for a in extra):
        cmd += ["--served-model-name", model.served_name]
    if model.demo:
        cmd.append("--demo-model")  # the engine reports demo_model: true in /stats; the page shows a banner
        if not any(a.startswith("--generation-config") for a in extra):
            cmd += ["--generation-config", str(DEMO_GENERATION_DIR)]   # the GGUF has no sampling defaults
    if not any(a.endswith("enable-prefix-caching") for a in extra):
        # A chat re-sends its whole history every turn: the cache skips the turns already computed.
        cmd.append("--enable-prefix-caching")
    if not any(a.startswith("--tool-call-parser") for a in extra):
        # Agents send tools with tool_choice "auto" (their default); Qwen writes hermes-style calls.
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if not any(a.startswith("--speculative-config") for a in extra) and gpu_memory(env) is None:
        cmd += ["--speculative-config", CPU_SPECULATIVE_CONFIG]
    return cmd + extra


# The engine's defaults for --max-num-seqs and --max-waiting-requests, and room for streams that are ending.
ENGINE_MAX_NUM_SEQS, ENGINE_MAX_WAITING = EngineArgs.max_num_seqs, ServerArgs.max_waiting_requests
UPSTREAM_ROOM = 64


def flag_value(args: list[str], flag: str, default: int) -> int:
    """The last value given for `flag` (as `--flag N` or `--flag=N`) in args, else default."""
    value = default
    for i, arg in enumerate(args):
        text = args[i + 1] if arg == flag and i + 1 < len(args) else arg.split("=", 1)[1] \
            if arg.startswith(flag + "=") else None
        if text is not None and text.strip().isdigit():      # a bad value is the engine's to refuse
            value = int(text)
    return value


def upstream_connections(engine_args: list[str]) -> int:
    """The proxy's pool for generations: everything the engine runs and queues, so that a request beyond that is
    answered by the engine (503 + Retry-After) instead of waiting in the proxy for a connection."""
    return (flag_value(engine_args, "--max-num-seqs", ENGINE_MAX_NUM_SEQS)
            + flag_value(engine_args, "--max-waiting-requests", ENGINE_MAX_WAITING) + UPSTREAM_ROOM)


def demo_notice(model: ResolvedModel, gpu=gpu_memory) -> None:
    say("-" * 78)
    say(f"NOTE: running the built-in demo model {model.served_name}: small and TEXT-ONLY, so answers are")
    say("simple and images are not understood. No model was given and none was found in the Hugging Face cache.")
    for line in hub.fetch_advice(gpu()):
        say(line)
    say("-" * 78)


class Supervisor:
    """One run: the engine and the proxy as children of this process.

    The engine's port answers only the proxy: each run makes a random key that the engine (env
    LOCALCHAT_PROXY_KEY) and the proxy (env ENGINE_API_KEY) alone receive, never on a command line. With
    `expose_engine` there is none, and the engine port is as open as its flags make it (the user's --api-key)."""

    def __init__(self, s: Settings, model: ResolvedModel, engine_args: list[str], api_key: str | None,
                 expose_engine: bool = False):
        self.s, self.model, self.engine_args, self.api_key = s, model, engine_args, api_key
        self.proxy_key = None if expose_engine else secrets.token_urlsafe(32)
        self.engine: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None

    def _children(self):
        # Stop order: the engine first, which ends open streams with an error event and [DONE] (the proxy
        # passes them on, and answers new requests 503 meanwhile); then the proxy.
        return (("engine", self.engine, self.s.engine_log), ("proxy", self.proxy, self.s.proxy_log))

    def start_engine(self, rotate_log: bool = True) -> subprocess.Popen:
        if rotate_log:
            procs.rotate(self.s.engine_log)
        env = {"VLLM_API_KEY": self.api_key or "", PROXY_KEY_ENV: self.proxy_key or ""}
        cmd = engine_command(self.s, self.model, self.engine_args) + ["--load-status-file",
                                                                     str(load_status_file(self.s))]
        say("engine: " + " ".join(cmd))
        self.engine = procs.spawn(cmd, self.s.engine_log, env=env, cwd=REPO)
        procs.write_pid(control.pid_file(self.s, "engine"), self.engine.pid, "engine")
        return self.engine

    def restart_engine(self) -> subprocess.Popen:
        """After a crash: whatever the dead engine left behind goes, the log goes on (it says why it died)."""
        procs.stop_tree(self.engine.pid, timeout=2)
        return self.start_engine(rotate_log=False)

    def engine_healthy(self) -> bool:
        return procs.http_status(self.s.engine_url + "/health", timeout=1.0) == 200

    def watch_engine(self) -> EngineWatch:
        watch = EngineWatch(self.restart_engine, self.engine_healthy,
                            RestartPolicy.from_env(start_timeout_s=self.s.engine_start_timeout),
                            EngineStatusFile(control.engine_status_file(self.s)), self.s.engine_log, say)
        watch.attach(self.engine)
        return watch

    def wait_engine(self) -> None:
        """Echo the engine's log until /health answers 200; fail if it exits or takes too long."""
        say(f"waiting for the engine at {self.s.engine_url}/health (log: {self.s.engine_log})")
        follower = procs.LogFollower(self.s.engine_log)
        start = last_output = time.monotonic()
        while True:
            for line in follower.new_lines():
                print(f"  [engine] {line}", flush=True)
                last_output = time.monotonic()
            if self.engine.poll() is not None:
                for line in follower.new_lines():
                    print(f"  [engine] {line}", flush=True)
                raise RuntimeError(f"the engine exited with code {self.engine.returncode} while starting; "
                                   f"see {self.s.engine_log}")
            if procs.http_status(self.s.engine_url + "/health", timeout=1.0) == 200:
                say(f"engine ready after {time.monotonic() - start:.1f}s")
                return
            waited = time.monotonic() - start
            if waited > self.s.engine_start_timeout:
                raise RuntimeError(f"the engine was not ready after {waited:.0f}s (ENGINE_START_TIMEOUT)")
            if time.monotonic() - last_output > 15:
                say(f"… still loading ({waited:.0f}s)")
                last_output = time.monotonic()
            time.sleep(POLL_S)

    def start_proxy(self) -> None:
        procs.rotate(self.s.proxy_log)
        cmd = [self.s.python, "-m", "proxy", "--host", self.s.proxy_host, "--port", str(self.s.proxy_port),
               "--engine-url", self.s.engine_url, "--static-dir", str(self.s.static_dir),
               "--engine-status-file", str(load_status_file(self.s)),
               "--supervisor-status-file", str(control.engine_status_file(self.s)),
               "--max-upstream-connections", str(upstream_connections(self.engine_args))]
        env = {"ENGINE_API_KEY": self.proxy_key or self.api_key or "", "VLLM_API_KEY": ""}
        self.proxy = procs.spawn(cmd, self.s.proxy_log, env=env, cwd=REPO)
        procs.write_pid(control.pid_file(self.s, "proxy"), self.proxy.pid, "proxy")
        deadline = time.monotonic() + 30
        # Any answer from /api/health (200, or 503 if the engine just died) means the proxy is listening.
        while procs.http_status(self.s.proxy_url + "/api/health", timeout=1.0) is None:
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start; see {self.s.proxy_log}:\n  "
                                   + "\n  ".join(procs.tail(self.s.proxy_log, 15)))
            time.sleep(POLL_S)

    def supervise(self) -> str:
        """Restart the engine whenever it dies (EngineWatch); block until the proxy exits and return why."""
        watch = self.watch_engine()
        while True:
            watch.poll()
            self.engine = watch.engine
            if self.proxy.poll() is not None:
                lines = "\n  ".join(procs.tail(self.s.proxy_log, 15))
                return (f"the proxy exited unexpectedly (code {self.proxy.returncode}); last lines of "
                        f"{self.s.proxy_log}:\n  {lines}")
            time.sleep(POLL_S)

    def stop_all(self) -> None:
        for role, proc, _ in self._children():
            if proc is not None and proc.poll() is None:
                say(f"stopping {role} (pid {proc.pid})…")
                procs.stop_tree(proc.pid)
            elif proc is not None:
                procs.stop_tree(proc.pid, timeout=2)  # its own children may outlive it
            procs.remove(control.pid_file(self.s, role))


def fetch_from_hub(s: Settings, model: ResolvedModel, plan: hub.DownloadPlan) -> ResolvedModel:
    """The repo's snapshot, downloaded as needed, its progress in the terminal and on the page (the load status
    file the proxy reads, as the engine's own progress later)."""
    if plan.missing_bytes:
        say(f"downloading {plan.ref} from {hub.endpoint()}: {plan.missing_bytes / 1e9:.1f} GB into {hub.cache_dir()}")
    load_progress.start(str(load_status_file(s)))
    terminal = hub.TerminalProgress(plan.ref)

    def progress(done: int, total: int) -> None:
        terminal(done, total)
        load_progress.downloading(done, total)
    path = hub.download(plan, progress if plan.missing_bytes else lambda done, total: None)
    return replace(model, path=path)


def start(s: Settings, model: ResolvedModel, engine_args: list[str], api_key: str | None,
          plan: hub.DownloadPlan | None = None, expose_engine: bool = False) -> int:
    """`plan`: a Hub model to download once the proxy serves the page (then the flags are fitted to it).
    `expose_engine`: no per-run proxy key, so that the engine's port answers clients directly."""
    for role, host, port, var in (("engine", s.engine_host, s.engine_port, "ENGINE_PORT"),
                                  ("proxy", s.proxy_host, s.proxy_port, "PROXY_PORT")):
        if not procs.port_free(host, port):
            say(f"port {port} ({role}) is already in use; stop what uses it or set {var}.")
            return 1
    sup = Supervisor(s, model, engine_args, api_key, expose_engine)
    procs.write_pid(control.pid_file(s, "supervisor"), os.getpid(), "supervisor")
    control.write_state(s, status="starting", model=model.describe(), pid=os.getpid())
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    code = 0
    try:
        say(f"model: {model.describe()}")
        for note in model.notes:
            say(note)
        if model.demo:
            demo_notice(model)
        # The proxy first: the page can be opened at once and shows the model loading.
        sup.start_proxy()
        say(f"Chat page: {s.proxy_url}/ (it shows the model loading)")
        if plan is not None:
            model = fetch_from_hub(s, model, plan)
            model, engine_args = fit_engine_flags(model, engine_args)
            for note in model.notes:
                say(note)
            sup.model, sup.engine_args = model, engine_args
        sup.start_engine()
        sup.wait_engine()
        control.write_state(s, status="ready", url=s.proxy_url + "/", model=model.describe(), pid=os.getpid())
        say("=" * 78)
        say(f"Ready. Open {s.proxy_url}/ in your browser.")
        if s.proxy_host in ("0.0.0.0", "::"):
            say(f"(listening on all interfaces, port {s.proxy_port})")
        if expose_engine:
            say(f"Engine API: {s.engine_url}/v1  ·  KV stats: curl {s.engine_url}/stats")
        else:
            say(f"API: {s.proxy_url}/v1  ·  KV stats: curl {s.proxy_url}/stats  (the engine's own port answers only "
                "the proxy; --expose-engine opens it)")
        say(f"Logs: {s.engine_log}, {s.proxy_log}.  Stop: Ctrl-C or ./start_all.sh stop")
        if model.demo:
            say(f"(demo model: text only; for images run ./run_app.sh --model /path/to/{TARGET_NAME})")
        say("=" * 78)
        reason = sup.supervise()
        say(reason)
        code = 1
    except StopRequested as sig:
        say(f"{sig} received, shutting down.")
    except (RuntimeError, hub.HubError) as err:
        say(f"error: {err}")
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        control.write_state(s, status="stopping", pid=os.getpid())
        sup.stop_all()
        control.clear_run_dir(s)
        say("stopped.")
    return code


def start_detached(s: Settings, argv: list[str]) -> int:
    """Run the supervisor in the background (its output in launcher.log); return once the app is ready."""
    procs.rotate(s.launcher_log)
    procs.remove(control.state_file(s))
    child = procs.spawn([s.python, "-m", "app", "start", *argv], s.launcher_log, cwd=REPO, tie_to_parent=False)
    follower = procs.LogFollower(s.launcher_log)
    try:
        while True:
            for line in follower.new_lines():
                print(line, flush=True)
            if control.read_state(s).get("status") == "ready" and child.poll() is None:
                print(f"[app] running in the background (pid {child.pid}); stop with ./start_all.sh stop", flush=True)
                return 0
            if child.poll() is not None:
                for line in follower.new_lines():
                    print(line, flush=True)
                return child.returncode or 1
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        child.terminate()
        child.wait(60)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    s = Settings.from_env()
    command = argv.pop(0) if argv else "help"
    if command == "stop":
        return control.stop(s)
    if command == "status":
        return control.status(s)
    if command != "start":
        print(__doc__)
        return 0 if command in ("help", "-h", "--help") else 2
    detach = "--detach" in argv
    argv = [a for a in argv if a != "--detach"]
    expose_engine = "--expose-engine" in argv or os.environ.get("LOCALCHAT_EXPOSE_ENGINE") == "1"
    alive = control.running(s)
    if alive:
        say(f"already running ({', '.join(f'{r} pid {p.pid}' for r, p in alive.items())}); "
            "stop it first: ./start_all.sh stop")
        return 1
    control.clear_run_dir(s)  # stale files of a run that was killed
    model_arg, rest = None, []
    it = iter(argv)
    for arg in it:
        if arg == "--model":
            model_arg = next(it, None)
        elif arg.startswith("--model="):
            model_arg = arg.split("=", 1)[1]
        elif arg != "--expose-engine":
            rest.append(arg)
    try:
        model = resolve_model(model_arg, tensor_parallel_size=tensor_parallel_size(rest))
    except ModelNotFound as err:
        say(f"error: {err}")
        if model_arg is None and not os.environ.get("MODEL_PATH"):
            for line in hub.fetch_advice(gpu_memory()):
                say(line)
        return 2
    plan = None
    if model.hub is not None:
        try:
            plan = hub.plan(model.hub)      # refused here (wrong id, gated, no network, no room) before anything starts
        except hub.HubError as err:
            say(f"error: {err}")
            return 1
    if detach:
        return start_detached(s, argv)  # the background launcher resolves the same model again
    engine_args, key = split_engine_args(rest)
    key = key or os.environ.get("ENGINE_API_KEY") or os.environ.get("VLLM_API_KEY")
    if plan is None:
        model, engine_args = fit_engine_flags(model, engine_args)
    return start(s, model, engine_args, key, plan, expose_engine)
