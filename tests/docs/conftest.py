from tests.analysis.test_html_browser import browser  # noqa: F401 (headless chromium, shared with the explorer test)
