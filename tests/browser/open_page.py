"""Open an HTML page in a real headless browser (Qt WebEngine: Chromium's engine,
from the PyQt6-WebEngine wheel, offscreen) and print, as JSON, what the page shows
once every image has decoded: its title, headings, images (alt text, decoded size,
laid-out size) and preformatted texts.

    python tests/browser/open_page.py PAGE.html [SCREENSHOT.png]

With a second argument, the whole page is also saved as a PNG screenshot (the view
grown to the page's height), for a person to read.
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


def main(path: str, screenshot: str | None = None) -> None:
    app = QApplication(sys.argv[:1])
    view = QWebEngineView()
    view.resize(1280, 900)
    view.show()  # offscreen: nothing is painted (nor grabbed) for a view never shown
    result = {}

    def read(_ok=True):
        view.page().runJavaScript(READ, answer)

    def answer(text):
        page = json.loads(text) if text else {"ready": False}
        if page.pop("ready"):
            result.update(page)
            if screenshot is None:
                app.quit()
                return
            view.resize(1280, min(int(page["height"]), 16000))
            QTimer.singleShot(1000, save)
        else:
            QTimer.singleShot(100, read)

    def save():
        view.grab().save(screenshot)
        app.quit()

    view.loadFinished.connect(read)
    view.load(QUrl.fromLocalFile(os.path.abspath(path)))
    QTimer.singleShot(60_000, app.quit)  # give up: the test sees an empty result
    app.exec()
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
