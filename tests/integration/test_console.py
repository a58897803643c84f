"""The web console in a real browser: Debian's chromium, headless, driven by selenium through
Debian's chromedriver (both installed by scripts/test-deps.sh), against the real stack (API
under gunicorn, a Celery worker running vLLM on the tiny model).

It signs in, cancels a batch and watches another (held back by the first) go from 0 to
100 %, downloads its output, opens a line, watches a job stream token by token and replays
it, reads the throughput chart; a wrong key shows an error; tenant B's console shows none of
tenant A's batches and jobs. Along the way: the key is never
in a URL, and the page raises no Content-Security-Policy or Trusted Types violation.

Screenshots of each page go to `test-artifacts/console/` (or `$LLMQ_TEST_ARTIFACTS/console/`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from app.services.dispatch import DispatchPlan, dispatch_plan
from app.services.health import live_capacities
from app.settings import Settings
from tests.helpers import ROOT, Stack, wait_for

pytestmark = pytest.mark.integration

ARTIFACTS = Path(os.environ.get("LLMQ_TEST_ARTIFACTS", str(ROOT / "test-artifacts"))) / "console"

STREAMED = 1500  # tokens of the job whose stream is watched live


# --- the browser ------------------------------------------------------------------------------


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(f"none of {names} is installed: run scripts/test-deps.sh (Debian's chromium)")


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-downloads")


@pytest.fixture(scope="module")
def browser(downloads: Path) -> Iterator[WebDriver]:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # this run's screenshots only
    ARTIFACTS.mkdir(parents=True)
    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    # Root on a CI machine: Chromium's sandbox needs user namespaces it does not get there.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    # Every request the page makes (to check that the key is in none of their URLs) and
    # the console's messages (to check that no policy violation was reported).
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(_binary("chromedriver")))
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, name: str) -> None:
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def until(check: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    """Polls `check` (every 50 ms) until it returns something true; returns that."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (NoSuchElementException, StaleElementReferenceException) as exc:  # not drawn yet, or redrawn
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what or check}" + (f" (last: {last})" if last else ""))


def css(driver: WebDriver, selector: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, selector)


def text(driver: WebDriver, selector: str) -> str:
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return str(found[0].text) if found else ""


def open_console(driver: WebDriver, stack: Stack, fragment: str = "") -> None:
    driver.get(f"{stack.url}/console/{fragment}")
    until(
        lambda: css(driver, "#sign-in").is_displayed() or css(driver, "#view").is_displayed(), what="the page"
    )


def sign_in(driver: WebDriver, stack: Stack, key: str) -> None:
    open_console(driver, stack)
    if css(driver, "#view").is_displayed():
        css(driver, "#sign-out").click()
    field = css(driver, "#key-input")
    field.clear()
    field.send_keys(key)
    css(driver, "#sign-in-button").click()


def fact(driver: WebDriver, name: str) -> str:
    """The value shown beside `name` in a page's facts."""
    return str(driver.find_element(By.XPATH, f"//dt[text()='{name}']/following-sibling::dd[1]").text)


def accept_confirm(driver: WebDriver) -> None:
    def alert() -> Any:
        try:
            return driver.switch_to.alert
        except NoAlertPresentException:
            return None

    until(alert, 5, "the confirm dialog").accept()


def request_urls(driver: WebDriver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def violations(driver: WebDriver) -> list[str]:
    words = ("Content Security Policy", "TrustedHTML", "Trusted Type", "Refused to")
    return [e["message"] for e in driver.get_log("browser") if any(w in e["message"] for w in words)]


# --- the stack ------------------------------------------------------------------------------


def new_key(services, name: str) -> str:  # type: ignore[no-untyped-def]
    return str(services.keys.create_key(f"{name}-{secrets.token_hex(3)}"))


def client(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def dispatch(stack: Stack) -> DispatchPlan:
    """How the stack's feeder sends batch lines (its worker's capacity, default settings)."""
    defaults = Settings.model_fields
    return dispatch_plan(
        live_capacities(redis.Redis.from_url(stack.env["LLMQ_REDIS_URL"]), stack.model),
        headroom=defaults["batch_dispatch_headroom"].default,
        chunk=defaults["batch_chunk_size"].default,
        cold_window=defaults["batch_cold_window"].default,
        ceiling=defaults["batch_dispatch_window"].default,
    )


def all_jobs(c: httpx.Client) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = c.get("/v2/jobs", params=params).json()
        jobs += page["data"]
        if not page["has_more"]:
            return jobs
        params["after"] = page["last_id"]


def make_batch(c: httpx.Client, model: str, max_tokens: list[int], tag: str) -> dict[str, Any]:
    body = b"".join(
        json.dumps(
            {
                "custom_id": f"{tag}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"{tag} line {i}: say something"}],
                    "max_tokens": n,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i, n in enumerate(max_tokens)
    )
    uploaded = c.post("/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    r = c.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"made_by": tag},
        },
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


# --- the tests ------------------------------------------------------------------------------


def test_a_wrong_key_shows_an_error_and_is_not_kept(browser: WebDriver, stack: Stack) -> None:
    sign_in(browser, stack, "llmq_not-a-key")
    message = until(lambda: text(browser, "#sign-in-error"), 15, "the sign-in error")
    assert message.startswith("Sign-in failed") and "key" in message.lower()
    assert css(browser, "#sign-in").is_displayed() and not css(browser, "#view").is_displayed()
    assert browser.execute_script("return window.sessionStorage.length") == 0
    shot(browser, "01-wrong-key")


def test_the_console_follows_batches_a_line_and_a_stream(
    browser: WebDriver, stack: Stack, services, downloads: Path
) -> None:
    started = time.monotonic()
    key = new_key(services, "console-a")
    browser.get_log("performance")  # only this test's requests from here on
    sign_in(browser, stack, key)
    until(lambda: css(browser, "#batches-table").is_displayed(), 15, "the batches page")
    assert browser.execute_script("return window.sessionStorage.getItem('llmq.console.key')") == key
    assert browser.execute_script("return window.localStorage.length") == 0
    assert browser.get_cookies() == []

    # Two batches of one tenant: the first (more lines than the feeder keeps out) holds the
    # second's lines back, as its deadline is earlier, so the second shows 0 % for as long
    # as the first runs. The second's lines end in two broker messages (chunks), a short one
    # and a long one, so the console sees it half done before it is done.
    plan = dispatch(stack)
    watched = [50] * plan.chunk + [1900] * plan.chunk
    with client(stack, key) as c:
        blocker = make_batch(c, stack.model, [1500] * (plan.window + plan.chunk), "block")
        batch = make_batch(c, stack.model, watched, "watch")
    first, second = (f'tr[data-batch-id="{b["id"]}"]' for b in (blocker, batch))
    until(
        lambda: css(browser, f"{first} .cancel-batch").is_displayed(), 15, "the first batch's cancel button"
    )
    until(lambda: text(browser, f"{second} .progress-label"), 15, "the second batch")
    percents = [int(css(browser, f"{second} progress").get_attribute("data-percent"))]
    assert percents == [0]
    shot(browser, "02-batches-one-waiting")

    # Cancelling the first from the console lets the second run.
    css(browser, f"{first} .cancel-batch").click()
    accept_confirm(browser)

    def progress() -> bool:
        value = int(css(browser, f"{second} progress").get_attribute("data-percent"))
        if value != percents[-1]:
            percents.append(value)
            if value not in (0, 100):
                shot(browser, "03-batch-in-progress")
        return value == 100 and "completed" in text(browser, f"{second} .status")

    until(progress, 120, "the second batch at 100 %")
    assert percents[0] == 0 and percents[-1] == 100, percents
    assert percents == sorted(percents) and len(percents) >= 3, percents
    until(lambda: "cancelled" in text(browser, f"{first} .status"), 60, "the first batch cancelled")
    shot(browser, "04-batches-cancelled-and-completed")
    with client(stack, key) as c:
        cancelled = c.get(f"/v1/batches/{blocker['id']}").json()
    assert cancelled["status"] == "cancelled" and cancelled["x_progress"]["cancelled"] > 0
    # Its cancelled lines can be retried: the console offers it now, not while it ran.
    assert css(browser, f"{first} .retry-batch").is_displayed()
    assert not css(browser, f"{first} .cancel-batch").is_displayed()

    browser.get(f"{stack.url}/console/#/batches/{batch['id']}")
    until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#lines-table .line-row")) == len(watched))
    assert "completed" in text(browser, ".toolbar .status")
    assert css(browser, ".toolbar progress").get_attribute("data-percent") == "100"
    shot(browser, "05-batch-completed")

    # Its output file, downloaded by the page with the key in a header.
    with client(stack, key) as c:
        done = c.get(f"/v1/batches/{batch['id']}").json()
        output = c.get(f"/v1/files/{done['output_file_id']}/content").content
    css(browser, ".download-output").click()
    saved = downloads / f"{batch['id']}_output.jsonl"
    until(lambda: saved.exists() and saved.read_bytes() == output, 15, "the downloaded output file")

    # The lines filtered by status, then one line: its request, response and stats.
    Select(css(browser, "#line-status")).select_by_value("failed")
    until(lambda: css(browser, "#lines-empty").is_displayed(), 10, "no failed lines")
    Select(css(browser, "#line-status")).select_by_value("succeeded")
    until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#lines-table .line-row")) == len(watched), 10)
    link = css(browser, "#lines-table .line-row a.job-link")
    line_job = link.get_attribute("href").rsplit("/", 1)[1]
    link.click()
    with client(stack, key) as c:
        job = c.get(f"/v2/jobs/{line_job}").json()
    number = int(job["custom_id"].rsplit("-", 1)[1])
    until(lambda: f"watch line {number}: say something" in text(browser, "#job-request"), 15, "its request")
    until(lambda: text(browser, "#job-response").startswith("{"), 15, "its response")
    assert json.loads(css(browser, "#job-response").get_property("textContent")) == job["response"]
    assert fact(browser, "Output tokens") == str(job["usage"]["completion_tokens"]) == str(watched[number])
    assert fact(browser, "Custom id") == job["custom_id"]
    content = job["response"]["choices"][0]["message"]["content"]
    until(lambda: text(browser, "#stream-state").startswith("replayed"), 15, "the line's stream")
    assert css(browser, "#stream .stream-text").get_property("textContent") == content
    shot(browser, "06-line")

    # A job streamed live, token by token, then replayed after the fact.
    with client(stack, key) as c:
        r = c.post(
            "/v2/jobs",
            json={
                "model": stack.model,
                "messages": [{"role": "user", "content": "Stream to the console."}],
                "max_tokens": STREAMED,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
    browser.get(f"{stack.url}/console/#/jobs/{job_id}")
    lengths: list[int] = []

    def streamed() -> bool:
        state = text(browser, "#stream-state")
        length = len(
            browser.execute_script("return document.querySelector('#stream .stream-text')?.textContent || ''")
        )
        if state.startswith("live") and (not lengths or length > lengths[-1]):
            lengths.append(length)
            if len(lengths) == 3:
                shot(browser, "07-job-streaming")
        return state.startswith("ended")

    until(streamed, 90, "the end of the stream")
    with client(stack, key) as c:
        finished = wait_for(c, [job_id])[job_id]
    full = finished["response"]["choices"][0]["message"]["content"]
    # Seen growing while live, in many steps, to the stored text.
    assert len(lengths) >= 5 and lengths == sorted(lengths), lengths
    assert 0 < lengths[0] < len(full)
    until(
        lambda: css(browser, "#stream .stream-text").get_property("textContent") == full, 10, "the full text"
    )
    until(lambda: "succeeded" in text(browser, ".toolbar .status"), 10, "the job's status")
    shot(browser, "08-job-streamed")
    css(browser, "#replay").click()
    until(lambda: text(browser, "#stream-state").startswith("replayed"), 60, "the replay")
    assert css(browser, "#stream .stream-text").get_property("textContent") == full
    shot(browser, "09-job-replayed")

    # The throughput chart counts what just ran, as the job records have it.
    with client(stack, key) as c:
        jobs = all_jobs(c)
    assert len(jobs) == (plan.window + plan.chunk) + len(watched) + 1
    ended = [j for j in jobs if j["status"] in ("succeeded", "failed", "cancelled", "expired")]
    tokens = sum((j["usage"] or {}).get("completion_tokens", 0) for j in ended)
    assert tokens >= sum(watched) + STREAMED
    browser.get(f"{stack.url}/console/#/batches")
    until(lambda: text(browser, "#throughput-jobs") == f"{len(ended):,}", 20, "the chart's jobs")
    bars = browser.find_elements(By.CSS_SELECTOR, ".bar-rect")
    assert len(bars) == 60 and sum(int(r.get_attribute("data-tokens")) for r in bars) == tokens
    assert text(browser, "#throughput-tokens") == f"{tokens:,}"
    shot(browser, "10-batches-and-throughput")

    # The key went in headers only: no request URL holds it.
    urls = request_urls(browser)
    assert any("/v2/jobs/" in u and u.endswith("/stream") for u in urls)
    assert not [u for u in urls if key in u]
    assert violations(browser) == []
    print(
        f"console flow: {time.monotonic() - started:.1f} s; batch progress seen: {percents}; "
        f"stream lengths seen while live: {len(lengths)}"
    )


def test_tenant_b_sees_none_of_tenant_a(browser: WebDriver, stack: Stack, services) -> None:
    key_a, key_b = new_key(services, "console-ta"), new_key(services, "console-tb")
    with client(stack, key_a) as c:
        batch = make_batch(c, stack.model, [4, 4], "secret-of-a")
        jobs = c.get("/v2/jobs", params={"batch_id": batch["id"]}).json()["data"]
    sign_in(browser, stack, key_b)
    until(lambda: css(browser, "#batches-empty").is_displayed(), 15, "B's empty batch list")
    until(lambda: text(browser, "#throughput-jobs") == "0", 15, "B's empty chart")
    shot(browser, "11-tenant-b-batches")
    for fragment in (f"#/batches/{batch['id']}", f"#/jobs/{jobs[0]['id']}"):
        browser.get(f"{stack.url}/console/{fragment}")
        notice = until(lambda: text(browser, "#notice"), 15, "the not-found notice")
        assert "no" in notice.lower() and ("batch" in notice.lower() or "job" in notice.lower()), notice
        # Only the id asked for, the notice and a way back: no panel of A's object.
        until(lambda: not browser.find_elements(By.CSS_SELECTOR, "#view .panel"), 10, "the empty page")
        source = browser.page_source
        assert "secret-of-a" not in source and "say something" not in source
    shot(browser, "12-tenant-b-on-a-batch")
    browser.get(f"{stack.url}/console/#/jobs")
    until(lambda: css(browser, "#jobs-empty").is_displayed(), 15, "B's empty job list")
    assert batch["id"] not in browser.page_source
