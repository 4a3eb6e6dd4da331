"""Open an HTML page in a real headless browser (Qt WebEngine: Chromium's engine,
from the PyQt6-WebEngine wheel, offscreen) and print, as JSON, what the page shows
once every image has decoded: its title, headings, images (alt text, decoded size,
laid-out size) and preformatted texts.

    python tests/browser/open_page.py PAGE.html [SCREENSHOT.png]
    python tests/browser/open_page.py PAGE.html SCREENSHOT.png PAGE.html SCREENSHOT.png ...

With a screenshot, the whole page is also saved as a PNG (the view grown to the
page's height), for a person to read. Several pages open in turn in one browser (one
start-up), a JSON line each.
"""

import json
import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Chromium refuses its sandbox as root (CI containers); no GPU here
os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--no-sandbox --disable-gpu")
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")

from PyQt6.QtCore import QTimer, QUrl  # noqa: E402
from PyQt6.QtWebEngineWidgets import QWebEngineView  # noqa: E402
from PyQt6.QtWidgets import QApplication  # noqa: E402

READ = """JSON.stringify({
  ready: Array.from(document.images).every(i => i.complete),
  title: document.title,
  headings: Array.from(document.querySelectorAll('h1, h2')).map(h => h.innerText),
  images: Array.from(document.images).map(i => ({
    alt: i.alt, width: i.naturalWidth, height: i.naturalHeight,
    shown: i.getBoundingClientRect().width})),
  texts: Array.from(document.querySelectorAll('pre')).map(p => p.innerText),
  panels: Array.from(document.querySelectorAll('img[data-series]')).map(i => ({
    alt: i.alt, series: JSON.parse(i.dataset.series), scale: i.dataset.scale})),
  table: Array.from(document.querySelectorAll('table.counts td:first-child')).map(
    c => c.innerText),
  height: document.documentElement.scrollHeight,
})"""


def main(pages: list[tuple[str, str | None]]) -> None:
    """Open each ``(page, screenshot or None)`` in turn in one browser; one JSON line
    each, in order (``{}`` for a page that did not finish loading in time)."""
    app = QApplication(sys.argv[:1])
    view = QWebEngineView()
    view.resize(1280, 900)
    view.show()  # offscreen: nothing is painted (nor grabbed) for a view never shown
    results: list[dict] = []
    timer = QTimer()
    timer.setSingleShot(True)

    def start():
        if len(results) == len(pages):
            app.quit()
            return
        results.append({})
        view.resize(1280, 900)
        view.load(QUrl.fromLocalFile(os.path.abspath(pages[len(results) - 1][0])))
        timer.start(60_000)  # give up on this page: the test sees an empty result

    def read(_ok=True):
        view.page().runJavaScript(READ, answer)

    def answer(text):
        page = json.loads(text) if text else {"ready": False}
        if not page.pop("ready"):
            QTimer.singleShot(100, read)
            return
        results[-1].update(page)
        if pages[len(results) - 1][1] is None:
            start()
            return
        view.resize(1280, min(int(page["height"]), 16000))
        QTimer.singleShot(1000, save)

    def save():
        view.grab().save(pages[len(results) - 1][1])
        start()

    timer.timeout.connect(start)
    view.loadFinished.connect(read)
    start()
    app.exec()
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if len(arguments) == 2 and arguments[1].endswith(".png"):
        main([(arguments[0], arguments[1])])
    elif len(arguments) == 1:
        main([(arguments[0], None)])
    else:  # PAGE SHOT PAGE SHOT ...
        main(list(zip(arguments[::2], arguments[1::2], strict=True)))
