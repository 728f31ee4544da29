"""Headless Chromium for the tests that look at sdq's pages as a person would: Debian's
chromium and chromedriver, driven by Selenium, with nothing downloaded at run time."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    options = Options()
    # Both paths given: Selenium's manager never looks for (or fetches) a browser.
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver: webdriver.Chrome, page: Path | str, screenshot: Path) -> list[bool]:
    """Opens a page from disk (or a URL), keeps a screenshot of it, and says of each image
    whether the browser loaded and decoded it."""
    driver.get(page if isinstance(page, str) else page.resolve().as_uri())
    driver.find_element(By.TAG_NAME, "table")
    driver.save_screenshot(str(screenshot))
    return driver.execute_script(
        "return Array.from(document.images, i => i.complete && i.naturalWidth > 0);"
    )


def texts(driver: webdriver.Chrome, selector: str) -> list[str]:
    return [element.text for element in driver.find_elements(By.CSS_SELECTOR, selector)]
