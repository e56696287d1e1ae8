"""``atoll dashboard``: served by the controller of a real ``atoll up``, behind the token.

The HTTP test runs everywhere. The browser test needs Chromium (Debian's
``chromium``, or ``chromium-browser``/``google-chrome``): it loads the page
headless and reads what the page's own JavaScript drew. Without one it
skips, and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atoll.transports.capnp import ClusterFile
from atoll.transports.testing import eventually_blocking

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    opener = urllib.request.build_opener(_NoRedirect)
    request = urllib.request.Request(url, headers=headers)
    try:  # header names as HTTP has them: in any case (lowered here)
        with opener.open(request, timeout=30) as answer:
            return answer.status, _lowered(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, _lowered(error.headers), error.read()


def _lowered(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _atoll(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "atoll.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        close_fds=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], str]]:
    """``atoll up --hosts 2`` and its dashboard: cluster file, env, URL (with token)."""
    cluster_file = tmp_path / "cluster.json"
    env = dict(os.environ)
    args = ["up", "--hosts", "2", "--devices-per-host", "1", "--cluster-file", str(cluster_file)]
    up = subprocess.Popen(
        [sys.executable, "-m", "atoll.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        close_fds=False,
    )
    assert up.stdout is not None
    try:
        for line in up.stdout:
            if "cluster up" in line:
                break
        shown = _atoll("dashboard", "--cluster-file", str(cluster_file), env=env)
        url = shown.split("atoll dashboard at ")[1].split()[0]
        yield cluster_file, env, url
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        up.stdout.close()


def _status(base: str, token: str) -> dict[str, Any]:
    code, _, body = _get(base + "api/status", **{"X-Atoll-Token": token})
    assert code == 200
    data: dict[str, Any] = json.loads(body)
    return data


def _hosts(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in data["rows"] if r["kind"] == "host"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_dashboard_needs_the_token_and_shows_hosts_die(
    cluster: tuple[Path, dict[str, str], str],
) -> None:
    cluster_file, env, url = cluster
    base, token = url.split("?")[0], ClusterFile.read(cluster_file).token.hex()
    assert base.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    assert _get(base)[0] == 401
    assert _get(base + "api/status", **{"X-Atoll-Token": "00" * 32})[0] == 401
    code, headers, _ = _get(f"{base}?token={token}")
    assert code == 303 and f"atoll_token={token}" in headers["set-cookie"]
    code, _, page = _get(base, Cookie=f"atoll_token={token}")
    assert code == 200 and b"<h2>hosts</h2>" in page

    data = _status(base, token)
    hosts = _hosts(data)
    assert [h["alive"] for h in hosts] == [True, True]
    assert set(data["utilization"]) <= {"0", "1"} and data["window_s"] == 60

    _atoll(
        "timeline",
        "--cluster-file",
        str(cluster_file),
        "--seconds",
        "0.5",
        "-o",
        str(cluster_file.parent / "t.json"),
        env=env,
    )
    code, _, timeline = _get(base + "api/timeline", **{"X-Atoll-Token": token})
    assert code == 200 and "traceEvents" in json.loads(timeline)

    os.kill(hosts[1]["pid"], signal.SIGKILL)

    def shown_lost() -> bool:
        return [h["alive"] for h in _hosts(_status(base, token))] == [True, False]

    eventually_blocking(shown_lost, "host 1 shown lost", timeout=30)


def _browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def _rendered(browser: str, url: str) -> str:
    """The page's DOM once its scripts ran (headless, virtual time)."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu"]
    command += ["--virtual-time-budget=5000", "--dump-dom", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, close_fds=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(
    _browser() is None,
    reason="browser test skipped: no chromium on this machine "
    f"(looked for {', '.join(BROWSERS)}); install Debian's chromium to run it",
)
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_page_in_a_headless_browser(cluster: tuple[Path, dict[str, str], str]) -> None:
    browser = _browser()
    assert browser is not None
    cluster_file, _, url = cluster
    dom = _rendered(browser, url)  # ?token= logs in, then the page loads with the cookie
    assert 'data-hosts="2"' in dom and 'data-lost="0"' in dom
    token = ClusterFile.read(cluster_file).token.hex()
    base = url.split("?")[0]
    pid = _hosts(_status(base, token))[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    lost = lambda: not _hosts(_status(base, token))[1]["alive"]  # noqa: E731
    eventually_blocking(lost, "host 1 lost in the status the page reads", timeout=30)
    assert 'data-lost="1"' in _rendered(browser, url)


@pytest.mark.skipif(_browser() is None, reason="browser test skipped: no chromium on this machine")
@pytest.mark.timeout(120)
def test_a_timeline_page_draws_the_demo_in_a_headless_browser(tmp_path: Path) -> None:
    from atoll.cli import main

    timeline, page = tmp_path / "demo.json", tmp_path / "demo.html"
    args = ["demo", "--virtual-clock", "--steps", "16", "--elements", "65536"]
    assert main([*args, "--timeline", str(timeline), "--timeline-page", str(page)]) == 0
    browser = _browser()
    assert browser is not None
    dom = _rendered(browser, page.as_uri())
    slices = [e for e in json.loads(timeline.read_text())["traceEvents"] if e["ph"] == "X"]
    assert f'data-slices="{len(slices)}"' in dom and len(slices) >= 16 + 15  # gangs, hops
    assert dom.count('<rect x="') == len(slices)  # drawn, not the script's template
