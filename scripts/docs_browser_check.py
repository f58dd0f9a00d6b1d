"""Open the built docs site in a headless Chromium; fail on a broken image or link.

Usage: python scripts/docs_browser_check.py build/site [--browser PATH] [--page PAGE ...]

Serves the site on 127.0.0.1 (standard library), then for each page (default: the home page
and seeing-a-run.html, the page with images) runs the browser's own ``--dump-dom`` on a copy
of the page with a small script added at its end. In the browser, after the page loaded,
that script
  - checks every <img>: loaded and decoded (``complete`` and ``naturalWidth > 0``);
  - fetches every same-site link (``<a href>``, stylesheets, scripts): HTTP 200, and for a
    link with ``#anchor``, an element with that id in the fetched page;
and writes what failed into the DOM, which this script reads back. Exit 0: nothing broken;
1: a broken image or link, each named on one line; 2: no browser or no site (one line).

The browser: ``--browser``, else $CHROMIUM, else the first of chromium-headless-shell,
chromium, chromium-browser, google-chrome on PATH (Debian: ``apt-get install
chromium-headless-shell``). Nothing is fetched from outside 127.0.0.1: the site is built with
``theme.font: false``.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
DEFAULT_PAGES = ("index.html", "seeing-a-run.html")
RESULT_ID = "docs-browser-check-result"

# Runs in the page after load; writes {"images": [...], "links": [...], "checked": n} as JSON
# into a <pre id=RESULT_ID>. The browser's virtual time budget lets the fetches finish.
PROBE = """
<script>
window.addEventListener("load", async () => {
  const broken = {images: [], links: [], checked: 0};
  for (const img of document.images) {
    broken.checked += 1;
    if (!img.complete || img.naturalWidth === 0) broken.images.push(img.getAttribute("src"));
  }
  const urls = new Set();
  for (const el of document.querySelectorAll("a[href], link[href], script[src]")) {
    const raw = el.getAttribute("href") || el.getAttribute("src");
    const url = new URL(raw, location.href);
    if (url.origin !== location.origin) continue;
    urls.add(url.href);
  }
  const pages = {};
  for (const href of urls) {
    broken.checked += 1;
    const url = new URL(href);
    const bare = url.href.split("#")[0];
    try {
      if (!(bare in pages)) {
        const r = await fetch(bare);
        pages[bare] = r.ok ? await r.text() : null;
      }
      if (pages[bare] === null) { broken.links.push(href + " (not found)"); continue; }
      const id = decodeURIComponent(url.hash.slice(1));
      if (id && bare.endsWith(".html")) {
        const doc = new DOMParser().parseFromString(pages[bare], "text/html");
        if (!doc.getElementById(id)) broken.links.push(href + " (no such anchor)");
      }
    } catch (e) {
      broken.links.push(href + " (" + e + ")");
    }
  }
  const out = document.createElement("pre");
  out.id = "RESULT_ID";
  out.textContent = JSON.stringify(broken);
  document.body.appendChild(out);
});
</script>
""".replace("RESULT_ID", RESULT_ID)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def find_browser(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("CHROMIUM"), *BROWSERS):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def probe_copy(site: Path, page: str) -> str:
    """A copy of ``page`` with the probe, beside it (so its relative links stay the same)."""
    source = site / page
    probed = source.with_name(f".probe-{source.name}")
    text = source.read_text(encoding="utf-8")
    text = text.replace("</body>", PROBE + "</body>", 1) if "</body>" in text else text + PROBE
    probed.write_text(text, encoding="utf-8")
    return str(probed.relative_to(site))


def check_page(browser: str, base: str, site: Path, page: str) -> dict:
    probed = probe_copy(site, page)
    try:
        with tempfile.TemporaryDirectory() as profile:
            proc = subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",  # CI containers run as root
                    "--disable-gpu",
                    "--no-first-run",
                    f"--user-data-dir={profile}",
                    "--virtual-time-budget=15000",
                    "--dump-dom",
                    f"{base}/{probed}",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        (site / probed).unlink(missing_ok=True)
    found = re.search(rf'<pre id="{RESULT_ID}">(.*?)</pre>', proc.stdout, flags=re.S)
    if not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the probe did not report (browser exit {proc.returncode}: {tail[0]})"}
    return json.loads(html.unescape(found.group(1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the built site (make docs: build/site)")
    parser.add_argument("--browser", help="a Chromium binary (default: found on PATH)")
    parser.add_argument("--page", action="append", help="a page to open (repeatable)")
    args = parser.parse_args(argv)
    site = args.site
    if not (site / "index.html").is_file():
        print(f"error: no built site at {site}; run `make docs` first", file=sys.stderr)
        return 2
    browser = find_browser(args.browser)
    if browser is None:
        print(
            "error: no headless Chromium found (tried $CHROMIUM, "
            + ", ".join(BROWSERS)
            + "); install one, e.g. `apt-get install chromium-headless-shell`",
            file=sys.stderr,
        )
        return 2
    server, base = serve(site)
    failed = 0
    try:
        for page in args.page or DEFAULT_PAGES:
            if not (site / page).is_file():
                print(f"error: {page} is not in the built site {site}", file=sys.stderr)
                return 2
            result = check_page(browser, base, site, page)
            if "error" in result:
                print(f"FAIL {page}: {result['error']}")
                failed += 1
                continue
            for src in result["images"]:
                print(f"FAIL {page}: broken image {src}")
            for link in result["links"]:
                print(f"FAIL {page}: broken link {link}")
            if result["images"] or result["links"]:
                failed += len(result["images"]) + len(result["links"])
            else:
                print(f"ok   {page}: {result['checked']} images and links checked")
    finally:
        server.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
