"""A headless Chromium driven over the DevTools protocol (aiohttp's websocket client, already installed with
lm-eval): open a Snakemake report, click an item's view button as a user does, read the text shown.

The report is a single-page app: its items are data URIs inside report.html, an HTML item opens in an iframe
(a CSV, JSON or TXT item's button is a download link instead). Site isolation is off, so the iframe's document
is in the page's process and an isolated world there can read its text.
"""

import asyncio
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    return next(filter(None, map(shutil.which, BROWSERS)), None)


class Page:
    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        while True:
            message = json.loads((await self.ws.receive()).data)
            if message.get("id") == n:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def js(self, expression: str, context: int | None = None):
        args = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        result = await self.call("Runtime.evaluate", **args, **({"contextId": context} if context else {}))
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait(self, expression: str, timeout: float = 30) -> object:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if value := await self.js(expression):
                return value
            await asyncio.sleep(0.2)
        raise TimeoutError(f"waited {timeout} s for {expression}")

    async def frame_text(self) -> str:
        """The text of the page's first iframe's document."""
        tree = await self.call("Page.getFrameTree")
        frames = tree["frameTree"].get("childFrames") or []
        if not frames:
            raise RuntimeError("no iframe in the page")
        world = await self.call("Page.createIsolatedWorld", frameId=frames[0]["frame"]["id"])
        return await self.js("document.body ? document.body.innerText : ''", world["executionContextId"])


@contextlib.asynccontextmanager
async def devtools_page(browser: str, workdir: Path, width: int | None = None):
    """Headless ``browser`` (a fresh profile under ``workdir``: no stale DevToolsActivePort; ``width`` px wide where
    given) and its blank page over the DevTools protocol, Page events enabled; the browser ended on leaving."""
    import aiohttp

    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=workdir))
    size = [f"--window-size={width},1000"] if width else []
    proc = subprocess.Popen(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", "--disable-site-isolation-trials", *size,
         "--disable-features=IsolateOrigins,site-per-process", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip():
                break
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                target = next(t for t in await response.json() if t["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                yield page
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


async def open_item(browser: str, report: Path, category: str, subcategory: str | None, item: str, workdir: Path):
    """Open ``report`` in ``browser``, show ``category`` (and ``subcategory``) as its menu does, and click the view
    button of the item named ``item``. Returns (the button's download attribute or None, the text shown)."""
    async with devtools_page(browser, workdir) as page:
        await page.call("Page.navigate", url=report.resolve().as_uri())
        await page.wait("typeof app !== 'undefined' && document.readyState === 'complete'", 60)
        # the menu's category view, as clicking the category (and subcategory) does
        if subcategory:
            view = {"navbarMode": "subcategory", "category": category, "subcategory": subcategory}
            await page.js(f"app.setView({json.dumps(view)}) || 1")
        else:
            await page.js(f"app.showCategory({json.dumps(category)}) || 1")
        name = json.dumps(item)
        find = (f"[...document.querySelectorAll('tr')].find(r => r.innerText.includes({name}))"
                "?.querySelector('a')")  # fmt: skip
        await page.wait(f"!!({find})", 30)
        download = await page.js(f"({find}).getAttribute('download')")
        if download is None:
            await page.js(f"({find}).click() || 1")
            await page.wait("!!document.querySelector('iframe')", 30)
            await asyncio.sleep(1)
            return None, await page.frame_text()
        return download, ""


def open_report_item(report: Path, category: str, subcategory: str | None, item: str, workdir: Path):
    browser = find_browser()
    if browser is None:
        raise RuntimeError(f"no browser ({', '.join(BROWSERS)}) on PATH")
    return asyncio.run(open_item(browser, report, category, subcategory, item, workdir))


WIDTH_JS = "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"


async def measure_items(browser: str, report: Path, items: list[tuple[str, str | None, str]], workdir: Path,
                        width: int = 1400, shots: Path | None = None) -> dict[str, tuple[int, int]]:  # fmt: skip
    """Open ``report`` at ``width`` px and, for the first page and each (category, subcategory, item) of
    ``items`` (HTML items, shown in an iframe as their view button shows them), the document's scrollWidth and
    clientWidth: a page wider than its frame has the first above the second. With ``shots``, a PNG of each
    view there. One load of the report for all of them (a 4 MB page)."""
    import base64

    widths: dict[str, tuple[int, int]] = {}
    async with devtools_page(browser, workdir, width) as page:
        await page.call("Emulation.setDeviceMetricsOverride", width=width, height=1000,
                        deviceScaleFactor=1, mobile=False)  # fmt: skip

        async def shoot(name: str) -> None:
            if shots is not None:
                data = (await page.call("Page.captureScreenshot", format="png"))["data"]
                (shots / f"{name}.png").write_bytes(base64.b64decode(data))

        await page.call("Page.navigate", url=report.resolve().as_uri())
        await page.wait("typeof app !== 'undefined' && document.readyState === 'complete'", 60)
        await asyncio.sleep(0.5)
        widths["first page"] = tuple(await page.js(WIDTH_JS))
        await shoot("first_page")
        for category, subcategory, item in items:
            # what the item's view button does (result_view_button.js): its data URI in the content frame
            name = json.dumps(item)
            path = await page.js(f"Object.keys(results).find(p => p.endsWith('/' + {name}))")
            if path is None:
                raise RuntimeError(f"no item {item} in {report}")
            view = {"navbarMode": "subcategory" if subcategory else "category", "category": category,
                    "subcategory": subcategory, "content": "html", "resultPath": path}  # fmt: skip
            await page.js(f"app.setView({{...{json.dumps(view)}, contentPath: results[{json.dumps(path)}]"
                          ".data_uri}) || 1")  # fmt: skip
            uri = f"results[{json.dumps(path)}].data_uri"
            await page.wait(f"document.querySelector('iframe')?.src === {uri}", 30)
            await asyncio.sleep(0.5)
            tree = await page.call("Page.getFrameTree")
            frame = (tree["frameTree"].get("childFrames") or [])[0]["frame"]["id"]
            world = await page.call("Page.createIsolatedWorld", frameId=frame)
            widths[item] = tuple(await page.js(WIDTH_JS, world["executionContextId"]))
            await shoot(item.replace(".", "_"))
    return widths


def report_widths(report: Path, items: list[tuple[str, str | None, str]], workdir: Path, width: int = 1400,
                  shots: Path | None = None) -> dict[str, tuple[int, int]]:  # fmt: skip
    browser = find_browser()
    if browser is None:
        raise RuntimeError(f"no browser ({', '.join(BROWSERS)}) on PATH")
    return asyncio.run(measure_items(browser, report, items, workdir, width, shots))
