"""`sao report RUN_DIR`: PNG panels and one HTML page, checked in headless Chromium (screenshot not
blank, every <img> decoded) on a synthetic metrics.jsonl with the keys docs/training.md lists."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import random
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from megatron_sao import cli
from megatron_sao.reporting.panels import PANELS
from megatron_sao.reporting.report import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _metrics_row(step: int, rng: random.Random) -> dict:
    """One step of a plausible SAO run: trainer keys (docs/training.md), buffer / staleness keys
    (pipeline/buffer.py) and the rollout accounting; no success metric and no rollout/aborted."""
    row = {
        "step": step, "train/reward_mean": 0.2 + 0.5 * (1 - math.exp(-step / 12)) + rng.uniform(-0.05, 0.05),
        "train/response_length_mean": 180 + 2 * step, "critic/explained_variance": 1 - math.exp(-step / 8),
        "critic/value_loss": 0.3 * math.exp(-step / 10), "actor/loss": rng.uniform(-0.05, 0.05),
        "actor/dis_masked_low_frac": 0.01 + 0.002 * rng.random(), "actor/dis_masked_high_frac": 0.002,
        "perf/tokens_per_s": 900 + rng.uniform(-50, 50), "staleness/mean": 0.8, "staleness/max": 3.0,
        "staleness/token_frac_0": 0.5, "staleness/token_frac_1": 0.3, "staleness/token_frac_2": 0.15,
        "staleness/token_frac_over": 0.05, "buffer/wait_s_mean": 0.4, "buffer/wait_s_max": 1.5,
        "time/wait_for_batch_s": 0.2, "rollout/started": 20 * step, "rollout/completed": 16 * step - 2,
        "rollout/failed": 2.0, "rollout/in_flight": 4 * step,
    }
    if step % 10 == 0:  # an evaluation during training of the policy after step - 5, logged when it finished
        row.update({"eval/success": 0.3 + step / 100, "eval/reward": 0.5 + step / 200, "eval/step": step - 5})
    if step <= 3:
        for key in [k for k in row if k.startswith("actor/")]:
            del row[key]  # critic warmup: no actor keys
    if step == 7:
        row["critic/explained_variance"] = float("nan")  # returns that do not vary
    return row


def _run_dir(tmp_path: Path, num_steps: int = 30) -> Path:
    run = tmp_path / "runs" / "sao_demo"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run:\n  name: tiny_sao\n")
    rng = random.Random(0)
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(1, num_steps + 1):
            f.write(json.dumps(_metrics_row(step, rng)) + "\n")
    return run


# ---- headless Chromium over the DevTools protocol on a pipe (no websocket client needed) --------


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium binary, installed from Debian's `chromium` package if missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("headless Chromium is not installed and cannot be here (needs apt-get as root): "
                    "install the Debian package `chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-qq", "install", "-y", "--no-install-recommends", "chromium"]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900, check=False)
    if done.returncode != 0:  # the package lists may be missing or old
        subprocess.run(["apt-get", "-qq", "update"], capture_output=True, env=env, timeout=600, check=False)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900, check=False)
    found = shutil.which("chromium")
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"the Debian package `chromium` could not be installed: {tail[0]}")
    return found


class Browser:
    """One headless Chromium page driven by CDP messages (JSON + NUL) on fds 3 (in) and 4 (out)."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                 "--no-first-run", "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"]
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(["bash", "-c", script, binary, *flags], pass_fds=(to_chrome_r, from_chrome_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._pending = b""
        self._events: list[dict] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1280, "height": 2400, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._from_chrome], [], [], remaining)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self._pending += chunk
        raw, self._pending = self._pending.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout_s: float = 60) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    def open(self, page: Path) -> None:
        self._events.clear()
        self.call("Page.navigate", {"url": page.resolve().as_uri()}, session=True)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                         session=True)["result"]["value"]

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"])

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):  # it may be gone already
            self.call("Browser.close", timeout_s=10)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to_chrome)
        os.close(self._from_chrome)


IMAGES_JS = "JSON.stringify(Array.from(document.images, i => [i.getAttribute('src'), i.complete, i.naturalWidth]))"


def _non_blank_fraction(png: bytes) -> float:
    """Share of pixels that are not (near) white."""
    from PIL import Image

    gray = Image.open(io.BytesIO(png)).convert("L")
    histogram = gray.histogram()
    return 1.0 - sum(histogram[245:]) / (gray.width * gray.height)


def test_the_page_shows_every_figure_in_headless_chromium(tmp_path: Path, chromium: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    run = _run_dir(tmp_path)
    assert cli.main(["report", str(run)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    page = run / "report" / "index.html"
    assert lines[-1] == str(page)  # the page's path is the last line
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert len(pngs) == len(PANELS) - 1  # all but the success panel (no success metric logged)
    assert all((page.parent / p).read_bytes().startswith(PNG_SIGNATURE) for p in pngs)

    browser = Browser(chromium, tmp_path / "profile")
    try:
        browser.open(page)
        images = json.loads(browser.evaluate(IMAGES_JS))
        assert sorted(src for src, _, _ in images) == pngs  # relative paths, one <img> per PNG
        assert all(complete and width > 0 for _, complete, width in images), images
        assert browser.evaluate("document.title") == "Run report: tiny_sao"
        shot = browser.screenshot()
        assert _non_blank_fraction(shot) > 0.05, "the screenshot is (nearly) blank"

        (page.parent / "rollout.png").unlink()  # the check must see a figure that did not load
        browser.open(page)
        broken = {src: width for src, _, width in json.loads(browser.evaluate(IMAGES_JS))}
        assert broken["rollout.png"] == 0 and broken["reward.png"] > 0
    finally:
        browser.close()


def test_not_logged_panels_and_keys_are_named_and_old_figures_removed(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    report = write_report(run)
    text = report.page.read_text()
    assert report.not_logged == ["Success rate"]
    assert "<b>Success rate</b>: not logged" in text
    assert "Not logged: rollout/aborted." in text  # the rollout panel is drawn without it
    assert "critic/explained_variance" in text and "steps 1-30 (30 logged)" in text

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with (run / "metrics.jsonl").open("w") as f:  # a run that logs success, and no rollout accounting
        for row in rows:
            row = {k: v for k, v in row.items() if not k.startswith("rollout/")}
            f.write(json.dumps({**row, "eval/success_rate": 0.5}) + "\n")
    report = write_report(run)
    assert report.not_logged == ["Rollout accounting"]
    assert (run / "report" / "success.png").is_file() and not (run / "report" / "rollout.png").exists()


def test_evaluation_during_training_is_drawn_at_the_step_it_evaluated(tmp_path: Path) -> None:
    from megatron_sao.reporting.metrics import read_metrics
    from megatron_sao.reporting.panels import panel_points

    run = _run_dir(tmp_path)
    rows = read_metrics(run / "metrics.jsonl")
    (heldout,) = [p for p in PANELS if p.name == "heldout_eval"]
    assert panel_points(heldout, rows, "eval/success") == ([5.0, 15.0, 25.0], [0.4, 0.5, 0.6])
    (success,) = [p for p in PANELS if p.name == "success"]
    assert success.present_keys({"eval/success", "eval/success/t0", "train/success_rate", "eval/success_rate"}) == \
        ["eval/success_rate", "train/success_rate"]  # held-out success has its own panel
    text = write_report(run).page.read_text()
    assert (run / "report" / "heldout_eval.png").is_file() and "<td>eval/success</td>" in text


def test_a_single_step_run_renders(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, num_steps=1)
    report = write_report(run, tmp_path / "elsewhere")
    assert report.page == tmp_path / "elsewhere" / "index.html"
    assert all(p.stat().st_size > 5_000 for p in report.figures)  # drawn, not empty canvases


def test_a_directory_without_metrics_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
