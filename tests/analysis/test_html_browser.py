"""The explorer in a real headless browser (Debian's chromium + chromium-driver via selenium; `make
test` installs them): no console error, no network request, one thumbnail per layer x head,
captions equal to head_stats, and clicking a thumbnail / hovering a token highlights exactly the
recorded weights (read back from the DOM). In CI a missing browser fails the test, never skips it.
"""

import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import matplotlib.image
import pytest
import torch

from tests.analysis.html_page import padded_recording, page_args
from tests.grid import variants
from torchformer.analysis import head_stats, to_html

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = [  # the lead's set that works on these machines: no GPU, no sandbox, nothing phoning home
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and DRIVER.exists()):
        message = f"{CHROMIUM} / {DRIVER} missing: `make test` installs them (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)  # only outside CI
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="tf-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # An explicit driver path: selenium's driver manager (which would download one) never runs.
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


WEB = ("http", "https", "ws", "wss")  # schemes of requests that can leave the machine


def load(driver, url: str, settle: float = 0.0) -> tuple[list[str], list[tuple[str, str | None]]]:
    """Load ``url`` and wait ``settle`` s more (scripts that load after the page); return (console
    errors, (URL, the document that asked) of every request)."""
    driver.get_log("performance"), driver.get_log("browser")  # drop what came before
    driver.get(url)
    time.sleep(settle)
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    requests = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requests.append((message["params"]["request"]["url"], message["params"].get("documentURL")))
    return errors, requests


def open_page(driver, path: Path) -> tuple[list[str], list[str]]:
    """Load ``path``; return (console errors, URLs the page requested other than itself)."""
    url = path.resolve().as_uri()
    errors, requests = load(driver, url)
    # Requests of the page itself, and any request anywhere that leaves the machine.
    asked = [r for r, by in requests if (by == url and r != url) or r.split(":", 1)[0] in WEB]
    return errors, [r for r in asked if not r.startswith("data:")]


def test_checks_catch_a_page_that_errs_and_fetches(browser, tmp_path):
    """The two page checks are not vacuous: a page with a script error and a remote image fails both."""
    bad = tmp_path / "bad.html"
    bad.write_text('<img src="http://127.0.0.1:9/x.png"><script>throw new Error("boom")</script>')
    errors, requests = open_page(browser, bad)
    assert any("boom" in e for e in errors)
    assert requests == ["http://127.0.0.1:9/x.png"]


def weights_in(driver, selector: str) -> torch.Tensor:
    values = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(n => n.getAttribute('data-weight'))",
        selector,
    )
    assert None not in values
    return torch.tensor([float(x) for x in values], dtype=torch.float64)


def hover(driver, css: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ActionChains(driver).move_to_element(driver.find_element(By.CSS_SELECTOR, css)).perform()


def non_background_pixels(png: bytes) -> float:
    image = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]  # (h, w, 3) in [0, 1]
    return float(((image < 0.95).any(-1)).mean())


ARCHS = {  # one grid row per family, each on the sdpa backend (recording swaps in math)
    arch: next(v for v in variants([arch]) if v["backend"] == "sdpa")
    for arch in ("decoder", "encoder", "encoder_decoder")
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_explorer_in_a_browser_shows_the_recorded_weights(browser, tmp_path, arch):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    v = ARCHS[arch]
    model, rec, ids, mask = padded_recording(v)
    b = 1  # the padded row: padded positions must not be drawn
    path = to_html(rec, batch_index=b, **page_args(v, ids, mask, b)).save(tmp_path / "explorer.html")
    errors, requests = open_page(browser, path)
    assert errors == [] and requests == []
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"

    cfg = model.config
    layers = cfg.n_layers + 2 * cfg.decoder_layers if arch == "encoder_decoder" else cfg.n_layers
    thumbs = browser.find_elements(By.CSS_SELECTOR, ".tf-thumb")
    assert len(thumbs) == layers * cfg.attention.n_heads

    # Captions: exactly head_stats of that module and head, on the padded row with its mask.
    real = mask[b].bool()
    for thumb in thumbs:
        c = rec.weights[thumb.get_attribute("data-name")]
        h = int(thumb.get_attribute("data-head-index"))
        padded_queries = not thumb.get_attribute("data-name").startswith("encoder")
        s = head_stats(c[b : b + 1], mask=real[None] if padded_queries else None)
        caption = thumb.find_element(By.CSS_SELECTOR, ".tf-stats")
        want = (float(s.entropy[h]), float(s.max_weight[h]), float(s.distance[h]))
        got = tuple(float(caption.get_attribute(a)) for a in ("data-entropy", "data-max-weight", "data-distance"))
        assert got == want
        shown = ["ent", f"{want[0]:.2f}", "\u00b7", "max", f"{want[1]:.2f}", "dist", f"{want[2]:.1f}"]
        assert caption.text.split() == shown

    # Click the last thumbnail (last layer, last head; cross-attention for encoder-decoders).
    last = thumbs[-1]
    name, h = last.get_attribute("data-name"), int(last.get_attribute("data-head-index"))
    last.click()
    assert "tf-selected" in last.get_attribute("class") and "tf-selected" not in thumbs[0].get_attribute("class")
    view = browser.find_element(By.ID, "tf-head-view")
    assert view.get_attribute("data-layer") == last.get_attribute("data-layer")
    assert view.get_attribute("data-head") == last.get_attribute("data-head") == str(len(rec.weights[name][0]) - 1)
    assert name in browser.find_element(By.ID, "tf-head-title").text
    w = rec.weights[name][b, h]  # (T, S) with padding
    q_keep = real if not name.startswith("encoder") else torch.ones(w.shape[0], dtype=torch.bool)
    k_keep = q_keep if not name.endswith("cross_attn") else torch.ones(w.shape[1], dtype=torch.bool)
    w = w[q_keep][:, k_keep].double()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tf-queries .tf-tok")) == w.shape[0]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tf-keys .tf-tok")) == w.shape[1]

    # Hover a query: the keys light up with its row; hover a key: the queries with its column.
    i, j = w.shape[0] - 1, 0
    hover(browser, f'#tf-queries .tf-tok[data-index="{i}"]')
    assert torch.equal(weights_in(browser, "#tf-keys .tf-tok"), w[i])  # float32 values, exactly
    assert browser.find_element(By.CSS_SELECTOR, "#tf-queries .tf-tok").get_attribute("data-weight") is None
    hover(browser, f'#tf-keys .tf-tok[data-index="{j}"]')
    assert torch.equal(weights_in(browser, "#tf-queries .tf-tok"), w[:, j])
    assert f'key {j} "' in browser.find_element(By.ID, "tf-readout").text

    # The mean over heads, chosen from the head menu.
    Select(browser.find_element(By.ID, "tf-head")).select_by_visible_text("mean over heads")
    hover(browser, f'#tf-queries .tf-tok[data-index="{i}"]')
    mean = rec.weights[name][b].double().mean(0)[q_keep][:, k_keep]
    torch.testing.assert_close(weights_in(browser, "#tf-keys .tf-tok"), mean[i], atol=1e-7, rtol=0)

    # Something is drawn (thumbnails, lines, matrix), and not everything is one colour.
    share = non_background_pixels(browser.get_screenshot_as_png())
    assert 0.05 < share < 0.9, share
    errors, _ = open_page(browser, path)  # reload: still no console error after the interaction above
    assert errors == []
