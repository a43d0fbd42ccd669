"""The documentation site in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make services`` installs with apt-get) driven by selenium, against
``site/`` served on 127.0.0.1.

The site is ``site/`` where ``make docs`` built it, else the test builds ``docs/`` into its own
temporary folder. The screenshots land in the test's temporary folder and, where ``site/`` exists, in
``site/_screenshots/`` (front.png, api.png). Without chromium or chromedriver the tests skip, saying
so; selenium is given both paths and Selenium Manager (which would download a driver) must not run.
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SITE = REPO / "site"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.isfile(p) and os.access(p, os.X_OK))]

pytestmark = [
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"{' and '.join(MISSING)} not installed (make services installs chromium and chromium-driver with apt-get)",
    ),
    pytest.mark.slow,  # a docs build where site/ is not built yet
]
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.common.selenium_manager import SeleniumManager  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SEARCH_TIMEOUT = 20.0  # seconds for the search page's script to load the index and list the results
DOCS_TIMEOUT = 600.0  # seconds to wait for the docs build that make test runs beside the suite


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``site/`` where it was built, else ``docs/`` built into a temporary folder (not strictly). Where
    ``make test`` builds ``site/`` beside the suite, it names in ``QUERN_DOCS_DONE`` the file the build
    writes its exit status to when it ends: the site is ``site/`` once that status is 0."""
    done = os.environ.get("QUERN_DOCS_DONE")
    if done:
        deadline = time.monotonic() + DOCS_TIMEOUT
        while not os.path.exists(done):
            if time.monotonic() > deadline:
                pytest.fail(f"the docs build beside the suite did not end within {DOCS_TIMEOUT:g} s ({done})")
            time.sleep(0.2)
        status = pathlib.Path(done).read_text().strip()
        assert status == "0", f"the docs build beside the suite failed (status {status}): make test shows its log"
        return SITE
    if (SITE / "index.html").is_file():
        return SITE
    out = tmp_path_factory.mktemp("site")
    build = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-d", str(out / ".doctrees"), str(DOCS), str(out)]
    run = subprocess.run(build, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and (out / "index.html").is_file(), run.stderr[-3000:]
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def url(site: pathlib.Path) -> Iterator[str]:
    """The site served as static files on a free port of 127.0.0.1, in a thread."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=site))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """Headless Chromium, 1280x900, from Debian's binaries; Selenium Manager is never asked."""

    def no_manager(self: object, args: list[str]) -> dict[str, str]:
        raise AssertionError(f"Selenium Manager ran ({args}): it would download a driver")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SeleniumManager, "binary_paths", no_manager)
        mp.setenv("SE_OFFLINE", "true")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _screenshot(driver: webdriver.Chrome, name: str, tmp_path: pathlib.Path, site: pathlib.Path) -> np.ndarray:
    """The window as a PNG in tmp_path (and site/_screenshots/ for a built site/), decoded as RGB(A)."""
    from matplotlib.image import imread

    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"no screenshot of {driver.current_url}"
    if site == SITE:
        (SITE / "_screenshots").mkdir(exist_ok=True)
        shutil.copyfile(path, SITE / "_screenshots" / path.name)
    pixels = imread(str(path))
    scale, width, height = driver.execute_script("return [devicePixelRatio, innerWidth, innerHeight]")
    assert pixels.shape[:2] == (round(height * scale), round(width * scale)), f"{path}: {pixels.shape}"
    return pixels


def _assert_not_blank(pixels: np.ndarray, what: str) -> None:
    colours, counts = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0, return_counts=True)
    others = 1 - counts.max() / counts.sum()
    # a page of text: many shades (anti-aliasing), and a fair share of pixels off the background
    assert len(colours) > 50 and others > 0.02, (
        f"{what} looks blank: {len(colours)} colours, {others:.1%} off the background"
    )


def test_front_page_renders_with_its_title(browser, url, site, tmp_path):
    browser.get(url + "index.html")
    assert "quern" in browser.title, browser.title
    assert browser.find_element(By.TAG_NAME, "h1").text.strip(), "the front page has no heading"
    _assert_not_blank(_screenshot(browser, "front", tmp_path, site), "the front page")


def test_api_page_renders_with_its_title(browser, url, site, tmp_path):
    browser.get(url + "reference/api.html")
    assert "API" in browser.title, f"{browser.current_url}: title {browser.title!r}"
    assert browser.find_elements(By.CSS_SELECTOR, "dl.py.class"), "the API page documents no class"
    _assert_not_blank(_screenshot(browser, "api", tmp_path, site), "the API page")


def test_search_box_finds_batch_at(browser, url):
    browser.get(url + "index.html")
    box = browser.find_element(By.CSS_SELECTOR, "input[name=q]")
    box.send_keys("batch_at", Keys.ENTER)

    def links_to_batch_at(driver: webdriver.Chrome) -> list[str]:
        links = driver.find_elements(By.CSS_SELECTOR, "#search-results a")
        hrefs = [link.get_attribute("href") or "" for link in links]
        return [h for h in hrefs if urllib.parse.urlsplit(h).fragment == "quern.Pipeline.batch_at"]

    found = WebDriverWait(browser, SEARCH_TIMEOUT).until(
        links_to_batch_at,
        message=f"no search result links to quern.Pipeline.batch_at within {SEARCH_TIMEOUT:.0f} s",
    )
    assert urllib.parse.urlsplit(browser.current_url).path.endswith("/search.html")
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(browser.current_url).query)["q"] == ["batch_at"]
    assert urllib.parse.urlsplit(found[0]).path.endswith("/reference/api.html"), found
