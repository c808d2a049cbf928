"""The collaboration's live page: what a volunteer or the organiser opens in a browser while a run goes on.

The monitor owns a :class:`DashboardState` (its history as chart columns, the active peers, the leaderboard, the
last checkpoint and the join command) and hands a JSON snapshot of it to a :class:`DashboardServer` after each
refresh. The server is an aiohttp application on its own thread and event loop: it only ever reads the latest
snapshot (already encoded bytes), so a slow, flooding or malformed client costs the monitor's aggregation
nothing but a share of the GIL for cheap handlers, and a client error never reaches the monitor.

What the page shows is chosen field by field here (never a dump of the config or of the environment), so it
holds nothing secret: no access tokens, keys or passwords. Its script and styles ship with the repository
(``common/dashboard_static/``) and the chart library is plotly.js from the pinned ``plotly`` wheel: nothing is
fetched from the internet, so the page works on an offline machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from common.checkpoints import CHECKPOINT_PATTERN, list_checkpoints
from common.config import RunConfig
from common.errors import UserError

logger = logging.getLogger(__name__)

# How to open the page in a headless Chromium on a machine without internet: the background-networking switches
# stop Chromium calling home (offline, those connections are refused), the rest keep a throwaway profile quiet
# and sandbox-free (as root). Used by the page's browser test and the screenshot script.
HEADLESS_CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

STATIC_DIR = Path(__file__).resolve().parent / "dashboard_static"
MAX_POINTS = 1000  # the charts keep between MAX_POINTS and 2 x MAX_POINTS points, however long the run
MAX_IN_FLIGHT = 64  # requests served at once; more get 503 at once instead of queueing behind each other
STATE_CACHE_SECONDS = 1  # browsers and proxies may reuse a snapshot this long
SECURITY_HEADERS = {
    # plotly.js injects its own <style> elements; everything else comes from this server
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def plotly_js_path() -> Path:
    """plotly.js as shipped inside the pinned ``plotly`` wheel (found without importing the Python package)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the dashboard needs the plotly package: pip install -r requirements.txt")
    path = Path(spec.submodule_search_locations[0]) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise UserError(f"the plotly package has no bundled plotly.min.js at {path}: reinstall requirements.txt")
    return path


def _finite(value: Optional[float]) -> Optional[float]:
    """JSON has no NaN or infinity (a browser's JSON.parse refuses them): such values become gaps."""
    return value if value is not None and math.isfinite(value) else None


class StepSeries:
    """The history as chart points, thinned so a long run never makes the snapshot grow without bound: every
    ``stride``-th global step is kept, and when the points pass 2 x ``max_points`` every other one is dropped and
    the stride doubles. The newest step is always shown."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points, self.stride, self.count = max_points, 1, 0
        self.points: List[dict] = []
        self.latest: Optional[dict] = None
        self.metric_names: set = set()

    def add(self, entry: dict) -> None:
        """``entry``: one line of the monitor's history (a ``StepAggregate.to_json()``)."""
        previous = self.latest
        if entry.get("samples_per_second"):  # the monitor's own figure: samples / time since the previous step
            interval = entry["samples"] / entry["samples_per_second"]
        elif previous is not None and previous["step"] == entry["step"] - 1 and entry["time"] > previous["time"]:
            interval = entry["time"] - previous["time"]  # end to end: compute and averaging together
        else:
            interval = entry["seconds"]  # the first step, or one after a gap in the history
        point = {
            "step": entry["step"],
            "time": entry["time"],
            "loss": _finite(entry["loss"]),
            "peers": entry["peers"],
            "samples": entry["samples"],
            "interval": interval if interval > 0 else None,
            "samples_per_second": _finite(entry["samples"] / interval) if interval > 0 else None,
            "metrics": {name: _finite(value) for name, value in entry["metrics"].items()},
            "used_share": _finite(entry.get("used_share")),
            "compute_share": _finite(entry.get("compute_share")),
        }
        self.metric_names.update(point["metrics"])
        if self.count % self.stride == 0:
            self.points.append(point)
            if len(self.points) > 2 * self.max_points:
                self.points = self.points[::2]
                self.stride *= 2
        self.count += 1
        self.latest = point

    def columns(self) -> dict:
        points = self.points if not self.points or self.points[-1] is self.latest else [*self.points, self.latest]
        return {
            "step": [point["step"] for point in points],
            "time": [point["time"] for point in points],
            "loss": [point["loss"] for point in points],
            "peers": [point["peers"] for point in points],
            "samples_per_second": [point["samples_per_second"] for point in points],
            "used_share": [point["used_share"] for point in points],
            "compute_share": [point["compute_share"] for point in points],
            "metrics": {name: [point["metrics"].get(name) for point in points] for name in sorted(self.metric_names)},
        }


class DashboardState:
    """Everything the page shows, kept by the monitor's thread; :meth:`to_json` is the snapshot served."""

    def __init__(self, run_id: str, target_batch_size: int, max_global_steps: int):
        self.run_id, self.target_batch_size, self.max_global_steps = run_id, target_batch_size, max_global_steps
        self.series = StepSeries()
        self.total_samples = 0
        self.resumed_steps = 0
        self.join_command = ""
        self.active_peers: List[str] = []
        self.leaderboard: List[dict] = []
        self.checkpoint: Optional[dict] = None  # {"step", "file", "time"} of the newest checkpoint on disk
        self.checkpoints_enabled = False
        self.started = time.time()

    def add_step(self, entry: dict) -> None:
        self.series.add(entry)
        self.total_samples += entry["samples"]

    def recent_step_interval(self) -> Optional[float]:
        """Median seconds per global step over the last few steps: how long a working peer stays silent."""
        intervals = [point["interval"] for point in self.series.points[-8:] if point["interval"]]
        return statistics.median(intervals) if intervals else None

    def swarm_samples_per_second(self, window: int = 10) -> Optional[float]:
        """Samples the swarm finished per second over its last ``window`` recorded steps."""
        points = [point for point in self.series.points[-window:] if point["interval"]]
        if not points:
            return None
        return sum(point["samples"] for point in points) / sum(point["interval"] for point in points)

    def to_json(self) -> dict:
        latest = self.series.latest
        return {
            "run_id": self.run_id,
            "generated": time.time(),
            "monitor_started": self.started,
            "global_step": latest["step"] if latest else None,
            "max_global_steps": self.max_global_steps,
            "target_batch_size": self.target_batch_size,
            "loss": latest["loss"] if latest else None,
            "used_share": latest["used_share"] if latest else None,
            "compute_share": latest["compute_share"] if latest else None,
            "total_samples": self.total_samples,
            "resumed_steps": self.resumed_steps,
            "active_peers": len(self.active_peers),
            "active_peer_names": sorted(self.active_peers),
            "samples_per_second": _finite(self.swarm_samples_per_second()),
            "checkpoint": self.checkpoint,
            "checkpoints_enabled": self.checkpoints_enabled,
            "join_command": self.join_command,
            "leaderboard": self.leaderboard,
            "series": self.series.columns(),
        }


class _RequestErrorLog(logging.LoggerAdapter):
    """The log aiohttp's request handler writes to. aiohttp logs a malformed request (a request line over the
    limit, a bad header), which it has already answered with 400, as an ERROR with a traceback: that is the
    client's fault, so here it is one DEBUG line, and a flood of bad requests cannot fill the monitor's log.
    Anything else that goes wrong while serving stays visible, as a WARNING with its traceback."""

    def exception(self, message, *args, exc_info=True, **kwargs) -> None:
        if isinstance(exc_info, BadHttpMessage):
            self.debug(f"{message % args}: {type(exc_info).__name__} (answered {exc_info.code})")
        else:
            self.warning(message, *args, exc_info=exc_info, **kwargs)


def encode_snapshot(state: dict) -> bytes:
    return json.dumps(state, allow_nan=False, separators=(",", ":")).encode()


class DashboardServer:
    """Serves the page, its assets and ``/api/state`` (the latest snapshot) from a thread of its own.

    ``start()`` returns once the socket is bound (a taken port is a one-line :class:`UserError`); ``publish()``
    swaps the snapshot in (an atomic reference assignment: no lock on the monitor's side); ``stop()`` closes
    the listener and every open connection and joins the thread.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.url: Optional[str] = None
        self._snapshot = encode_snapshot({"global_step": None})
        self._plotly_js = plotly_js_path()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._in_flight = 0

    def publish(self, state: dict) -> None:
        self._snapshot = encode_snapshot(state)

    def start(self, timeout: float = 30.0) -> str:
        self._thread = threading.Thread(target=self._run, name="dashboard", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise UserError(f"the dashboard did not start within {timeout:.0f} s")
        if self._error is not None:
            raise UserError(
                f"the dashboard cannot listen on {self.host}:{self.port} ({self._error}): choose another "
                "monitor.dashboard_port (0 = any free port) or set monitor.dashboard=false"
            )
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopping is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the dashboard's thread did not stop in time; it ends with the process")

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # after start-up: report, never take the monitor down
            if not self._ready.is_set():
                self._error = error
                self._ready.set()
            else:
                logger.warning(f"the dashboard stopped: {type(error).__name__}: {error}")

    async def _serve(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(middlewares=[self._limit_and_label], client_max_size=1024)
        app.router.add_get("/", self._index)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/vendor/plotly.min.js", self._plotly)
        app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
        # no access log (a busy page would flood the monitor's log); the parser answers a request line or
        # header over 8 KiB (huge query strings) with 400 itself, before any handler runs
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            logger=_RequestErrorLog(logging.getLogger(f"{__name__}.requests"), {}),
            max_line_size=8190,
            max_field_size=8190,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port, shutdown_timeout=1.0)
            await site.start()
            host, port = runner.addresses[0][:2]
            shown_host = f"[{host}]" if ":" in host else host
            self.url = f"http://{shown_host}:{port}/"
            self._ready.set()
            await self._stopping.wait()
        finally:
            await runner.cleanup()

    @web.middleware
    async def _limit_and_label(self, request: web.Request, handler) -> web.StreamResponse:
        if self._in_flight >= MAX_IN_FLIGHT:
            response = web.Response(status=503, text="busy: too many requests at once, retry shortly")
        else:
            self._in_flight += 1
            try:
                response = await handler(request)
            except web.HTTPException as error:  # 404, 405, ...: a plain text answer with the same headers
                response = web.Response(status=error.status, text=f"{error.status} {error.reason}")
            finally:
                self._in_flight -= 1
        response.headers.update(SECURITY_HEADERS)
        return response

    async def _index(self, _request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def _state(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self._snapshot,
            content_type="application/json",
            headers={"Cache-Control": f"max-age={STATE_CACHE_SECONDS}"},
        )

    async def _plotly(self, _request: web.Request) -> web.StreamResponse:
        return web.FileResponse(self._plotly_js, headers={"Cache-Control": "max-age=86400"})


URL_FILE = "dashboard_url.txt"  # the page's address, for launchers (scripts/local_swarm.py prints it)
ACTIVE_MIN_SECONDS = 60.0  # a trainer silent for longer than this (and 3 step intervals) counts as gone


class Dashboard:
    """The monitor's handle on its page: feed it steps, peer sightings and checkpoints, then :meth:`publish`.

    All of it runs on the monitor's thread; the server only sees the encoded snapshots ``publish`` hands over.
    """

    def __init__(self, host: str, port: int, run_id: str, target_batch_size: int, max_global_steps: int):
        self.state = DashboardState(run_id, target_batch_size, max_global_steps)
        self.server = DashboardServer(host, port)
        self.last_seen: Dict[str, tuple] = {}  # peer key -> (display name, unix time of its newest step record)

    def start(self, output_dir: Path, history: List[dict], leaderboard_rows=()) -> str:
        """Load the recorded history and leaderboard (a restarted monitor shows the whole run at once), bind,
        and write the URL file."""
        for entry in history:
            self.state.add_step(entry)
        self.state.resumed_steps = len(history)
        url = self.server.start()
        self.publish(leaderboard_rows)
        (output_dir / URL_FILE).write_text(url + "\n")
        logger.info(f"dashboard: the run's live page is at {url}")
        return url

    def saw_peer(self, key: str, name: str, newest_record_time: float) -> None:
        previous = self.last_seen.get(key)
        if previous is None or newest_record_time >= previous[1]:
            self.last_seen[key] = (name, newest_record_time)

    def active_peer_names(self, now: float) -> List[str]:
        """Trainers whose newest record is recent: within a minute, or three step intervals for slow swarms."""
        interval = self.state.recent_step_interval() or 0.0
        window = max(ACTIVE_MIN_SECONDS, 3 * interval)
        return [name for name, seen in self.last_seen.values() if now - seen <= window]

    def publish(self, leaderboard_rows) -> None:
        """Snapshot now. ``leaderboard_rows``: the monitor's rows (``peer``, ``samples``, ``steps``, ``first_seen``,
        ``last_seen``, and ``used_share``/``compute_share`` where known); only those public fields are copied,
        ranked by samples."""
        self.state.active_peers = self.active_peer_names(time.time())
        self.state.leaderboard = [
            {
                "peer": str(row["peer"]),
                "samples": int(row["samples"]),
                "steps": int(row["steps"]),
                "hours_online": (row["last_seen"] - row["first_seen"]) / 3600,
                "last_seen": row["last_seen"],
                "used_share": _finite(row.get("used_share")),
                "compute_share": _finite(row.get("compute_share")),
            }
            for row in sorted(leaderboard_rows, key=lambda row: -row["samples"])
        ]
        self.server.publish(self.state.to_json())

    def checkpoint_saved(self, step: int, path: Path) -> None:
        """Shown by file name and time only: the organiser's folder layout is nobody else's business."""
        self.state.checkpoint = {"step": step, "file": path.name, "time": path.stat().st_mtime}

    def stop(self) -> None:
        self.server.stop()


def start_dashboard(
    config: RunConfig, output_dir: Path, history: List[dict], checkpoint_dir: Path, leaderboard_rows=()
) -> Optional[Dashboard]:
    """The monitor's page if ``monitor.dashboard`` is on (else None), already serving the recorded history."""
    if not config.monitor.dashboard:
        (output_dir / URL_FILE).unlink(missing_ok=True)  # a launcher must not print an earlier run's address
        return None
    dashboard = Dashboard(
        config.monitor.dashboard_host,
        config.monitor.dashboard_port,
        config.collaboration.run_id,
        config.collaboration.target_batch_size,
        config.training.max_global_steps,
    )
    dashboard.state.checkpoints_enabled = config.monitor.checkpoint_every_steps > 0
    existing = list_checkpoints(checkpoint_dir)
    if existing:
        step = int(CHECKPOINT_PATTERN.search(existing[-1].name).group(1))
        dashboard.checkpoint_saved(step, existing[-1])
    dashboard.start(output_dir, history, leaderboard_rows)
    return dashboard
