"""The monitor's live page: its server on its own (errors, limits, shutdown, nothing secret), then in a real
headless browser during a live local swarm, and under a flood of bad requests while the monitor keeps recording."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from common.config import load_config
from common.dashboard import HEADLESS_CHROMIUM_FLAGS, URL_FILE, Dashboard, DashboardServer, StepSeries
from common.errors import ConfigError, UserError
from common.swarm import LocalSwarm
from tests.helpers import ROOT, TINY_ALBERT, assert_no_processes_left, read_jsonl, swarm_overrides

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [*HEADLESS_CHROMIUM_FLAGS, "--window-size=1400,1800"]


def history_entry(step: int, time_: float, loss: float = 5.0, metrics=None) -> dict:
    return {
        "step": step,
        "peers": 2,
        "samples": 100,
        "loss": loss,
        "seconds": 2.0,
        "time": time_,
        "metrics": metrics if metrics is not None else {"accuracy": 0.5},
        "contributions": {"a": 60, "b": 40},
    }


def get(url: str, timeout: float = 10.0):
    """(status, body) of a GET; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def raw_request(url: str, request: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes that no HTTP library would (a malformed request line), return the start of the answer."""
    host, port = url.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as connection:
        connection.sendall(request)
        return connection.recv(200)


@pytest.fixture
def server():
    server = DashboardServer("127.0.0.1", 0)
    server.start()
    yield server
    server.stop()


def test_series_thins_long_runs_and_keeps_the_newest_step():
    series = StepSeries(max_points=50)
    for step in range(1000):
        series.add(history_entry(step, 1000.0 + 3 * step))
    columns = series.columns()
    assert 50 <= len(columns["step"]) <= 101
    assert columns["step"][0] == 0 and columns["step"][-1] == 999
    assert columns["step"] == sorted(columns["step"])
    # consecutive steps 3 s apart, 100 samples each
    assert columns["samples_per_second"][-1] == pytest.approx(100 / 3)


def test_non_finite_values_become_gaps_not_invalid_json(server):
    series = StepSeries()
    series.add(history_entry(0, 10.0, metrics={"accuracy": float("nan")}))
    series.add(history_entry(1, 12.0, loss=float("inf")))
    server.publish({"series": series.columns()})
    status, body = get(server.url + "api/state")
    assert status == 200
    parsed = json.loads(body)  # strict JSON: NaN would not parse in a browser
    assert parsed["series"]["metrics"]["accuracy"] == [None, 0.5]
    assert parsed["series"]["loss"] == [5.0, None]


def test_page_assets_and_clean_errors(server, caplog):
    caplog.set_level(logging.DEBUG)
    status, page = get(server.url)
    assert status == 200 and b"vendor/plotly.min.js" in page and b"static/app.js" in page
    assert b"http://" not in page and b"https://" not in page  # nothing from a CDN
    status, plotly = get(server.url + "vendor/plotly.min.js")
    assert status == 200 and len(plotly) > 1_000_000 and b"plotly.js" in plotly[:200]
    for asset in ("static/app.js", "static/style.css"):
        assert get(server.url + asset)[0] == 200
    assert get(server.url + "nope")[0] == 404
    assert get(server.url + "static/../dashboard.py")[0] in (403, 404)
    assert get(server.url + "static/")[0] in (403, 404)  # no directory listing
    assert get(server.url + "?q=" + "a" * 100_000)[0] in (400, 414)
    assert raw_request(server.url, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.")
    post = urllib.request.Request(server.url + "api/state", data=b"{}", method="POST")
    try:
        urllib.request.urlopen(post, timeout=10)
        status = 200
    except urllib.error.HTTPError as error:
        status = error.code
    assert status == 405  # read-only
    with urllib.request.urlopen(server.url + "api/state", timeout=10) as response:
        assert "default-src 'self'" in response.headers["Content-Security-Policy"]
    # a client's bad request is the client's problem: answered, and at most a DEBUG line in the monitor's log
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []
    assert any("LineTooLong" in record.getMessage() for record in caplog.records)


def test_many_concurrent_clients_get_answers(server):
    server.publish({"global_step": 3})

    def fetch(index: int) -> int:
        return get(server.url + ("api/state" if index % 2 else f"missing{index}"))[0]

    with ThreadPoolExecutor(max_workers=50) as pool:
        statuses = list(pool.map(fetch, range(200)))
    assert set(statuses) <= {200, 404, 503}
    assert statuses.count(200) > 0


def test_a_taken_port_is_a_one_line_user_error(server):
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    second = DashboardServer("127.0.0.1", port)
    with pytest.raises(UserError, match="monitor.dashboard_port"):
        second.start()


def test_stop_ends_the_server_thread():
    server = DashboardServer("127.0.0.1", 0)
    url = server.start()
    assert get(url + "api/state")[0] == 200
    server.stop()
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "api/state", timeout=5)


def test_dashboard_config_is_validated():
    config = load_config(TINY_ALBERT, ["monitor.dashboard=true", "monitor.dashboard_port=0"])
    assert config.monitor.dashboard and config.monitor.dashboard_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="dashboard_port"):
        load_config(TINY_ALBERT, ["monitor.dashboard_port=70000"])
    with pytest.raises(ConfigError, match="dashboard_host"):
        load_config(TINY_ALBERT, ["monitor.dashboard_host= "])


def test_leaderboard_and_snapshot_carry_only_public_fields(tmp_path):
    dashboard = Dashboard("127.0.0.1", 0, "run", 64, 10)
    dashboard.start(tmp_path, [history_entry(0, time.time())])
    try:
        secret_row = {
            "peer": "alice",
            "peer_id": "Qm",
            "samples": 10,
            "steps": 1,
            "first_seen": 1.0,
            "last_seen": 3601.0,
            "token": "SECRET-TOKEN",
        }
        dashboard.saw_peer("Qm", "alice", time.time())
        dashboard.publish([secret_row])
        status, body = get((tmp_path / URL_FILE).read_text().strip() + "api/state")
        state = json.loads(body)
        assert status == 200 and b"SECRET-TOKEN" not in body
        assert state["leaderboard"] == [
            {
                "peer": "alice",
                "samples": 10,
                "steps": 1,
                "hours_online": 1.0,
                "last_seen": 3601.0,
                "used_share": None,
                "compute_share": None,
            }
        ]
        assert state["active_peers"] == 1 and state["resumed_steps"] == 1
    finally:
        dashboard.stop()


class HeadlessChromium:
    """A real browser driven over the DevTools protocol (aiohttp's websocket client): open a page, evaluate
    expressions in it as it updates, take screenshots."""

    def __init__(self, profile: Path):
        self.process = subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.endpoint = self._read_endpoint()
        self.message_id = 0

    def _read_endpoint(self) -> str:
        deadline = time.monotonic() + 60
        for line in self.process.stderr:
            if "DevTools listening on ws://" in line:
                threading.Thread(target=self.process.stderr.read, daemon=True).start()  # keep the pipe drained
                return line.split("ws://", 1)[1].split("/", 1)[0]
            if time.monotonic() > deadline:
                break
        raise RuntimeError("chromium did not open its DevTools endpoint")

    async def _page_socket(self, session: aiohttp.ClientSession) -> str:
        async with session.get(f"http://{self.endpoint}/json/list") as response:
            targets = await response.json()
        return next(target["webSocketDebuggerUrl"] for target in targets if target["type"] == "page")

    async def _call(self, socket_, method: str, **params) -> dict:
        self.message_id += 1
        await socket_.send_json({"id": self.message_id, "method": method, "params": params})
        async with asyncio.timeout(60):
            async for message in socket_:
                reply = json.loads(message.data)
                if reply.get("id") == self.message_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
        raise RuntimeError("the browser closed the DevTools connection")

    def run(self, steps):
        """``steps(call)``: an async function given ``call(method, **params)`` on the open page."""

        async def session_main():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(await self._page_socket(session), max_msg_size=64 << 20) as socket_:
                    return await steps(lambda method, **params: self._call(socket_, method, **params))

        return asyncio.run(session_main())

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


# What a person sees, read from the rendered page: the numbers on the cards, the leaderboard's rows, and the loss
# chart as drawn: its SVG line and the markers plotly puts on each point.
SEEN = """(() => {
  if (document.readyState !== 'complete' || !document.getElementById('global-step')) return null;  // still loading
  const line = document.querySelector('#chart-loss .scatterlayer path.js-line');
  return JSON.stringify({
    step: document.getElementById('global-step').textContent,
    peers: document.getElementById('active-peers').textContent,
    rate: document.getElementById('samples-per-second').textContent,
    join: document.getElementById('join-command').textContent,
    status: document.getElementById('status').textContent,
    rows: Array.from(document.querySelectorAll('#leaderboard tbody tr')).map(tr => tr.cells[1].textContent),
    charts: Array.from(document.querySelectorAll('#charts .chart')).map(div => div.dataset.title),
    loss_line: line ? (line.getAttribute('d') || '').includes('L') : false,
    loss_points: document.querySelectorAll('#chart-loss .scatterlayer .points path.point').length,
    updates: Number(document.body.dataset.updates || 0),
  });
})()"""


def start_swarm_with_dashboard(swarm: LocalSwarm, trainers=("trainer0", "trainer1")) -> str:
    """A monitor with its page on a free port, then the trainers; returns the page's URL."""
    swarm.start_first_peer("monitor", "monitor", ["monitor.dashboard=true", "monitor.dashboard_port=0"])
    for name in trainers:
        swarm.start("trainer", name)
    return (swarm.output_dir / "monitor" / URL_FILE).read_text().strip()


def monitor_log_errors(run_dir: Path) -> list:
    return [line for line in (run_dir / "monitor/peer.log").read_text().splitlines() if " ERROR " in line]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup_env.sh installs it as root)")
def test_a_browser_sees_the_live_run(tmp_path, tiny_overrides):
    steps = 8
    trainers = ["trainer0", "trainer1"]
    with LocalSwarm(TINY_ALBERT, tmp_path / "run", swarm_overrides(tiny_overrides, steps, 128, 2)) as swarm:
        url = start_swarm_with_dashboard(swarm)
        browser = HeadlessChromium(tmp_path / "profile")
        try:

            async def watch(call):
                await call("Page.enable")
                await call("Page.navigate", url=url)
                seen, first, deadline = None, None, time.monotonic() + 240
                while time.monotonic() < deadline:
                    result = await call("Runtime.evaluate", expression=SEEN, returnByValue=True)
                    if result.get("exceptionDetails") or result["result"].get("value") is None:
                        await asyncio.sleep(0.5)  # the page is still loading (or navigating)
                        continue
                    seen = json.loads(result["result"]["value"])
                    ready = seen["loss_line"] and len(seen["rows"]) >= 2 and seen["peers"].isdigit()
                    if first is None and ready and int(seen["peers"]) >= 2:
                        first = seen
                    if first is not None and seen["step"] != first["step"]:
                        break  # the same page load picked up a newer global step: it polls
                    await asyncio.sleep(1.0)
                shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
                return first, seen, base64.b64decode(shot["data"])

            first, last, screenshot = browser.run(watch)
        finally:
            browser.close()
        (tmp_path / "dashboard.png").write_bytes(screenshot)
        assert swarm.wait(trainers, timeout=300), "trainers did not finish in time"
        swarm.stop_many(["monitor"])
        assert swarm.peers["monitor"].process.returncode == 0, swarm.peers["monitor"].log_tail()
    assert first is not None, f"the page never showed >= 2 active peers, a loss curve and leaderboard rows: {last}"
    assert sorted(first["rows"]) == trainers
    assert (
        first["loss_line"]
        and first["loss_points"] >= 2
        and "loss" in first["charts"]
        and "swarm samples/s" in first["charts"]
        and "share of computed samples used" in first["charts"]
    )
    assert float(first["rate"].replace(",", "")) > 0
    monitor_peer_id = swarm.initial_peers[0].rsplit("/p2p/", 1)[1]
    assert "scripts/train.py --config" in first["join"] and f"/p2p/{monitor_peer_id}" in first["join"]
    assert last["step"] != first["step"] and last["updates"] > first["updates"], (first, last)
    assert last["status"].startswith("live")
    assert screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(screenshot) > 20_000
    assert monitor_log_errors(tmp_path / "run") == []
    assert_no_processes_left(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bad_requests_get_clean_errors_while_the_monitor_keeps_recording(tmp_path, tiny_overrides):
    steps = 8
    trainers = ["trainer0", "trainer1"]
    run_dir = tmp_path / "run"
    history_path = run_dir / "monitor/history.jsonl"
    with LocalSwarm(TINY_ALBERT, run_dir, swarm_overrides(tiny_overrides, steps, 128, 2)) as swarm:
        url = start_swarm_with_dashboard(swarm)
        deadline = time.monotonic() + 300
        while len(read_jsonl(history_path)) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        recorded_before = len(read_jsonl(history_path))
        assert recorded_before >= 1, "the monitor recorded no step"

        def bad_request(index: int):
            kind = index % 4
            if kind == 0:
                return get(url + f"no/such/page{index}")[0]
            if kind == 1:
                return get(url + "api/state?" + "x" * 100_000)[0]
            if kind == 2:
                return raw_request(url, b"NONSENSE / HTTP/9.9\r\n\r\n")[:12].decode(errors="replace")
            return get(url + "api/state")[0]

        answers = []
        with ThreadPoolExecutor(max_workers=50) as pool:  # 50 clients at once, a bounded number of rounds
            for _ in range(4):
                answers += list(pool.map(bad_request, range(200)))
        assert {answer for index, answer in enumerate(answers) if index % 4 == 0} <= {404, 503}
        assert {answer for index, answer in enumerate(answers) if index % 4 == 1} <= {400, 414, 503}
        assert all(answer.startswith("HTTP/1.") for index, answer in enumerate(answers) if index % 4 == 2)
        assert {answer for index, answer in enumerate(answers) if index % 4 == 3} <= {200, 503}
        assert swarm.wait(trainers, timeout=300), "trainers did not finish in time"
        time.sleep(2)  # the monitor's last refreshes
        status, body = get(url + "api/state")
        swarm.stop_many(["monitor"])
        assert swarm.peers["monitor"].process.returncode == 0, swarm.peers["monitor"].log_tail()
    history = read_jsonl(history_path)
    # the flood neither stopped nor stalled aggregation: every global step is recorded, in order
    assert [entry["step"] for entry in history] == list(range(steps)), (recorded_before, history)
    assert status == 200 and json.loads(body)["global_step"] >= steps - 3
    assert monitor_log_errors(run_dir) == []
    assert_no_processes_left(tmp_path)

    # a restarted monitor reloads history.jsonl: the page shows the whole run again
    with LocalSwarm(TINY_ALBERT, run_dir, swarm_overrides(tiny_overrides, steps, 128, 2)) as swarm:
        url = start_swarm_with_dashboard(swarm, trainers=())
        deadline = time.monotonic() + 60
        state = json.loads(get(url + "api/state")[1])
        while not state["join_command"] and time.monotonic() < deadline:  # set once the DHT is up
            time.sleep(0.5)
            state = json.loads(get(url + "api/state")[1])
        swarm.stop_many(["monitor"])
    assert state["resumed_steps"] == steps and state["series"]["step"] == list(range(steps))
    assert sorted(row["peer"] for row in state["leaderboard"]) == trainers
    assert_no_processes_left(tmp_path)


def test_static_assets_name_no_task_metric():
    """The page draws whatever metrics the history holds: like the core's code, its assets name none."""
    for path in (ROOT / "common/dashboard_static").iterdir():
        text = path.read_text().lower()
        assert not any(word in text for word in ("mlm", "sop", "swav")), path
