"""The run dashboard in a real headless browser (Chromium through Playwright) against
`canvasq serve --with-worker`: a batch's live progress, its tok/s chart, its errors, and a row's
trace plot. Screenshots go to $CANVASQ_TEST_ARTIFACTS (else the test's tmp dir)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from openai import OpenAI

from tests.harness.server import ENDPOINT, ServerProcess, batch_lines, cli, poll, upload
from tests.harness.workers import worker_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (.ci/run installs the Debian package)")
def test_dashboard_shows_progress_errors_and_trace(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    art = Path(os.environ.get("CANVASQ_TEST_ARTIFACTS") or tmp_path)
    art.mkdir(parents=True, exist_ok=True)
    env = worker_env(
        db_url=f"sqlite:///{tmp_path / 'canvasq.sqlite'}",
        broker_url="redis://127.0.0.1:1/0",
        decode_batch_size=16,
        chunk_size=16,
        extra={"CANVASQ_FILES_DIR": str(tmp_path / "files")},
    )
    key = cli(env, "keys", "create", "--project", "alpha").stdout.strip()
    other = cli(env, "keys", "create", "--project", "beta").stdout.strip()
    with ServerProcess(env, tmp_path / "serve.log", with_worker=True) as srv:
        srv.wait_ready(deadline_s=180)
        client = OpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        b = client.batches.create(
            input_file_id=upload(client, batch_lines("d", 32)).id, endpoint=ENDPOINT, completion_window="24h"
        )
        late = client.batches.create(
            input_file_id=upload(client, batch_lines("late", 16)).id,
            endpoint=ENDPOINT,
            completion_window="1s",
        )  # behind the first: it expires
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{srv.url}/dashboard")
            expect(page.locator("#status")).to_have_text("enter an API key")
            page.fill("#key", key)
            page.click("#key-form button")
            row = page.locator(f'#batches tr[data-id="{b.id}"]')
            expect(row).to_be_visible(timeout=15_000)
            expect(page.locator(f'#batches tr[data-id="{late.id}"]')).to_be_visible()
            page.screenshot(path=str(art / "dashboard-list.png"))
            expect(row.locator(".status")).to_have_text("completed", timeout=180_000)
            expect(row.locator(".progress")).to_have_text("32/32")
            row.click()
            page.wait_for_function(
                "() => { const p = document.querySelector('#trace polyline.series-rows');"
                " return p && Number(p.dataset.n) > 1; }",
                timeout=30_000,
            )
            assert int(page.locator("#trace polyline.series-commits").get_attribute("data-n")) > 1
            assert int(page.locator("#tokps polyline.series-tok_s").get_attribute("data-n")) >= 1
            page.screenshot(path=str(art / "dashboard-trace.png"), full_page=True)
            # the expired batch: its rows' errors by code
            assert poll(client, late.id, deadline_s=120, server=srv).status == "expired"
            page.locator(f'#batches tr[data-id="{late.id}"]').click()
            expect(page.locator('#errors tr[data-code="expired"]')).to_be_visible(timeout=15_000)
            page.screenshot(path=str(art / "dashboard-errors.png"), full_page=True)
            # another project's key sees none of it
            page.fill("#key", other)
            page.click("#key-form button")
            expect(page.locator("#batches tbody tr")).to_have_count(0, timeout=10_000)
            browser.close()
    assert (art / "dashboard-trace.png").stat().st_size > 10_000
