"""The two-run comparison in a real browser: headless Chromium opens the MLflow UI (the full ``mlflow``
package's pages, served by the tracking server) at the results view's link, and reads what it drew.

Chromium is Debian's (``apt-get install -y chromium``), driven over its DevTools protocol (the
``websocket-client`` the Kubernetes client already brings); no browser is downloaded. Without Chromium the
test is skipped, saying how to get it. The screenshots are kept in the test's directory; their paths are
printed (``pytest -s``).

What the page does with the link and the records, in MLflow's code (mlflow/mlflow):
``mlflow/server/js/src/experiment-tracking/components/experiment-page/hooks/useExperimentPageViewMode.tsx``
(``compareRunsMode=CHART`` opens the chart view), ``.../hooks/useSharedExperimentViewState.ts`` (the saved
view ``viewStateShareKey`` names, an experiment tag), ``.../runs-charts/runs-charts.types.ts`` (the view's
chart cards), ``.../experiment-page/models/ExperimentPageUIState.tsx`` (its columns and their widths), and
``mlflow/server/js/src/experiment-tracking/routes.tsx`` (the ``#/experiments/<id>/runs`` route).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from rloo.tracking.experiment import RESULTS_VIEW_QUERY
from rloo.tracking.tags import TAG_PROMOTION
from rloo.tracking.ui import RUNS_QUERY
from tests.fixtures.servers import MlflowServer
from tests.tracking.test_run_names import pipeline_run

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium to check the MLflow UI in: apt-get install -y chromium (Debian/Ubuntu)",
)
_WAIT_S = 90.0  # the UI's first load on a busy 2-core machine


class Page:
    """One Chromium tab, over the DevTools protocol."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, what: str, check: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + _WAIT_S
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(0.5)
        text = self.evaluate("document.body ? document.body.innerText.slice(0, 2000) : ''")
        raise AssertionError(f"the page never showed {what}; it shows:\n{text}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"screenshot: {path}")
        return path


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    websocket = pytest.importorskip("websocket")
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",  # root in a container has no user namespace for Chromium's sandbox
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1920,1400",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "Chromium did not start"
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            (tab,) = [t for t in json.load(r) if t["type"] == "page"]
        ws = websocket.create_connection(tab["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        try:
            yield Page(ws)
        finally:
            ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _promote(client: MlflowClient, parent_id: str, status: str) -> None:
    """The push stage's record of its decision: a push run under the pipeline run tagged with it, and the
    pipeline run too (rloo.push.registry.Registry._mark, when a newer champion supersedes it)."""
    from rloo.tracking.lifecycle import start_stage_run

    parent = client.get_run(parent_id)
    push = start_stage_run(
        "push",
        client=client,
        experiment=client.get_experiment(parent.info.experiment_id).name,
        parent_run_id=parent_id,
        run_name="push",
    )
    for run_id in (push.run_id, parent_id):
        client.set_tag(run_id, TAG_PROMOTION, status)
    client.set_terminated(push.run_id)


_CURVES_JS = """(() => {
  const lines = [...document.querySelectorAll('path.js-line')].filter(p => (p.getAttribute('d') || '').length > 20);
  return lines.length;
})()"""
_RUN_LINKS_JS = (
    """[...document.querySelectorAll('a')].map(a => a.innerText.trim()).filter(t => t.startsWith('seed='))"""
)
_CUT_HEADERS_JS = """[...document.querySelectorAll('.ag-header-cell-text, .ag-header-cell-label span')]
  .filter(e => e.innerText && e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)"""


def test_the_printed_link_shows_two_runs_curves_the_champion_and_what_differs(
    tracking_env: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, page: Page
) -> None:
    experiment = f"browser-{uuid.uuid4().hex[:8]}"
    client = MlflowClient(tracking_env.uri)
    runs = [pipeline_run(experiment, tmp_path, monkeypatch, learning_rate=5e-4, seed=seed) for seed in (1, 2)]
    _promote(client, runs[0][1], "superseded")
    _promote(client, runs[1][1], "champion")
    exp_id = client.get_experiment_by_name(experiment).experiment_id
    names = [client.get_run(parent_id).info.run_name for _, parent_id in runs]

    # the link: the runs page of the experiment, in the results view's chart view
    page.open(f"{tracking_env.uri}/#/experiments/{exp_id}/runs{RUNS_QUERY}&{RESULTS_VIEW_QUERY}")
    page.wait_for("two reward curves", lambda: page.evaluate(_CURVES_JS) >= 2)
    curves = page.evaluate(_CURVES_JS)
    time.sleep(1.0)  # the other cards of the view finish drawing
    page.screenshot(tmp_path / "compare-chart-view.png")
    # the card of what differs: the seed among the parameters (the promotion among the tags, further down)
    text = page.wait_for(
        "what differs", lambda: (t := page.evaluate("document.body.innerText")) and "Compare by" in t and t
    )
    assert curves >= 2
    assert "\nseed\n" in text and "\nlearning_rate\n" not in text  # the same in both: not listed
    shown = page.evaluate(_RUN_LINKS_JS)
    assert sorted(set(shown)) == sorted(names), shown  # the pipeline runs, their stages folded under them
    # the runs list and the legends cut names short: the first words tell the two apart
    assert names[0][:12] != names[1][:12] and names[0].startswith("seed=1")

    # the table view of the same view: the promotion column, the headline results' headers in full
    page.open(f"{tracking_env.uri}/#/experiments/{exp_id}/runs{RUNS_QUERY}&viewStateShareKey=rloo-results")
    page.wait_for(
        "the promotion column",
        lambda: (
            "rloo.promotion" in (page.evaluate("document.body.innerText") or "")
            and "Result/gain_vs_sft" in page.evaluate("document.body.innerText")
        ),
    )
    time.sleep(1.0)  # the column widths are applied once the grid has laid out
    page.screenshot(tmp_path / "results-table-view.png")
    assert page.evaluate(_CUT_HEADERS_JS) == []
    cells = page.evaluate("document.body.innerText")
    assert "champion" in cells and "superseded" in cells
