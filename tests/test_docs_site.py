"""The built documentation site, tested in headless Chromium over HTTP.

Every page loads without a console error, an uncaught exception or a failed same-origin
request; no link or ``#anchor`` is broken; the navigation and the search work; the API
reference pages render the objects they name.

Run it with ``nox -s docs`` (which builds the site with ``mkdocs build --strict`` and
points ``RPCX_DOCS_SITE`` at it), or ``pytest tests/test_docs_site.py`` with mkdocs, its
plugins and playwright installed (the module then builds the site into a temporary
directory itself). The browser is Debian's ``chromium`` package (``/usr/bin/chromium``),
not Playwright's own download; without it, or without playwright, the module skips.

The site is served by ``http.server`` on 127.0.0.1 and a port the OS picks, because the
theme's search runs in a web worker that fetches its index, which ``file://`` forbids.
A request to another origin is aborted and counted as a problem: the site must work
offline (mkdocs.yml turns the theme's Google Fonts off for that).
"""

from __future__ import annotations

import ast
import functools
import html.parser
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

try:
    from playwright.sync_api import (
        Browser,
        ConsoleMessage,
        Page,
        Request,
        Response,
        Route,
        expect,
        sync_playwright,
    )
    from playwright.sync_api import Error as PlaywrightError
except ImportError:
    pytest.skip("needs the playwright Python package (and Debian's `chromium` package); "
                "`nox -s docs` runs it", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("needs Chromium: install Debian's `chromium` package (/usr/bin/chromium); "
                "`nox -s docs` runs it", allow_module_level=True)
if not os.environ.get("RPCX_DOCS_SITE") and importlib.util.find_spec("mkdocs") is None:
    pytest.skip("mkdocs is not installed and RPCX_DOCS_SITE is not set: `nox -s docs` "
                "builds the site and runs this module", allow_module_level=True)

pytestmark = pytest.mark.timeout(180)

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
TIMEOUT_MS = 15_000  # any one browser action or wait
CRAWL_TABS = max(1, min(4, os.cpu_count() or 1))  # pages the crawl loads side by side
BUILD_TIMEOUT_S = 180
LOCAL_HOSTS = {"localhost", "0.0.0.0", "::1", "[::1]"}
# True once the theme's search worker has loaded the index (or where there is no search).
SEARCH_READY_JS = """() => {
    const meta = document.querySelector('.md-search-result__meta');
    return meta === null || meta.textContent.trim() !== 'Initializing search';
}"""
# An <h1>'s text without its permalink (the pilcrow that toc's permalink adds).
H1_TEXT_JS = """h => {
    const copy = h.cloneNode(true);
    copy.querySelectorAll('.headerlink').forEach(e => e.remove());
    return copy.textContent.trim();
}"""


# -- the site, its server and the browser ---------------------------------------------------

@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$RPCX_DOCS_SITE, or the site built now with ``mkdocs build --strict``."""
    given = os.environ.get("RPCX_DOCS_SITE")
    if given:
        path = Path(given)
        if not (path / "index.html").is_file():
            pytest.fail(f"RPCX_DOCS_SITE={given!r} is not a built site (no index.html)",
                        pytrace=False)
        return path.resolve()
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict",
           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S,
                              env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mkdocs build took over {BUILD_TIMEOUT_S} s:\n{e.stdout!s}\n{e.stderr!s}",
                    pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {done.returncode}):\n"
                    f"{done.stdout}\n{done.stderr}", pytrace=False)
    return out.resolve()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a connection the browser dropped; the browser's side reports real failures


@pytest.fixture(scope="module")
def base_url(site_dir: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT/`` serving the site, from a daemon thread."""
    server = _QuietServer(("127.0.0.1", 0),
                          functools.partial(_QuietHandler, directory=str(site_dir)))
    thread = threading.Thread(target=server.serve_forever, name="docs-site-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium (Debian's), once per module."""
    with sync_playwright() as pw:
        launched = pw.chromium.launch(headless=True, executable_path=CHROMIUM,
                                      args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class _Watch:
    """What went wrong on the page being visited: console errors, uncaught exceptions,
    same-origin requests that failed or answered >= 400."""

    origin: str
    current: str = ""
    problems: list[tuple[str, str]] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)  # other origins' URLs, aborted by us

    def same_origin(self, url: str) -> bool:
        return urlsplit(url).netloc == self.origin

    def external(self, url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https", "ws", "wss") and parts.netloc != self.origin

    def abort(self, route: Route) -> None:
        # The site must be whole without the internet (closed networks, privacy): a page
        # that asks another origin for anything is a problem, and is not let through.
        self.aborted.add(route.request.url)
        self.problems.append((self.current, f"request to another origin: {route.request.url}"))
        route.abort()

    def on_console(self, msg: ConsoleMessage) -> None:
        if msg.type != "error":
            return
        if msg.location.get("url") in self.aborted and "net::ERR_FAILED" in msg.text:
            return  # our own abort of another origin's resource
        where = f"{msg.location.get('url')}:{msg.location.get('lineNumber')}"
        self.problems.append((self.current, f"console error: {msg.text} ({where})"))

    def on_pageerror(self, error: PlaywrightError) -> None:
        self.problems.append((self.current, f"uncaught exception: {error}"))

    def on_requestfailed(self, request: Request) -> None:
        if request.url in self.aborted:
            return
        self.problems.append((self.current, f"request failed: {request.url} "
                                            f"({request.failure})"))

    def on_response(self, response: Response) -> None:
        if response.status >= 400 and self.same_origin(response.url):
            self.problems.append((self.current, f"HTTP {response.status}: {response.url}"))


def _open_page(browser: Browser, base_url: str) -> tuple[Page, _Watch]:
    """A fresh context and page: desktop-sized (the sidebar navigation and the search box
    are shown), other origins aborted, every problem recorded in the returned _Watch."""
    watch = _Watch(origin=urlsplit(base_url).netloc)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    context.set_default_navigation_timeout(TIMEOUT_MS)
    context.route(watch.external, watch.abort)
    page = context.new_page()
    page.on("console", watch.on_console)
    page.on("pageerror", watch.on_pageerror)
    page.on("requestfailed", watch.on_requestfailed)
    page.on("response", watch.on_response)
    return page, watch


@pytest.fixture
def page(browser: Browser, base_url: str) -> Iterator[Page]:
    """A fresh page of its own context, closed after the test."""
    opened, _ = _open_page(browser, base_url)
    try:
        yield opened
    finally:
        opened.context.close()


def _site_pages(site_dir: Path) -> list[str]:
    """Every page of the site as a URL path relative to its root ('' for the home page):
    each index.html outside assets/ and search/."""
    pages = []
    for rel in sorted((index.parent.relative_to(site_dir).as_posix()
                       for index in site_dir.rglob("index.html")), key=lambda r: (r != ".", r)):
        if rel.split("/")[0] in ("assets", "search"):
            continue
        pages.append("" if rel == "." else rel + "/")
    return pages


def _wait_search_ready(page: Page) -> None:
    page.wait_for_function(SEARCH_READY_JS, timeout=TIMEOUT_MS)


def _open_search(page: Page) -> None:
    """Wait for the search to have indexed the site, then focus its box (shown in the header
    at this viewport's width)."""
    try:
        _wait_search_ready(page)
    except PlaywrightError:
        pytest.fail(f"the search was still 'Initializing search' after {TIMEOUT_MS // 1000} s: "
                    f"its index (search/search_index.json) did not load", pytrace=False)
    page.locator("input.md-search__input").click()


def _h1(page: Page) -> str:
    return str(page.locator(".md-content h1").evaluate(H1_TEXT_JS))


@dataclass
class _Crawl:
    pages: list[str]
    problems: list[tuple[str, str]]
    links: dict[str, list[tuple[str, str]]]  # page -> [(href as written, resolved URL)]


@pytest.fixture(scope="module")
def crawl(browser: Browser, base_url: str, site_dir: Path) -> Iterator[_Crawl]:
    """Every page visited once: its problems and its rendered links.

    CRAWL_TABS pages load side by side (most of a page's time is the search worker
    indexing in the browser); each has its own _Watch, so a problem names its page."""
    tabs = [_open_page(browser, base_url) for _ in range(CRAWL_TABS)]
    pages = _site_pages(site_dir)
    links: dict[str, list[tuple[str, str]]] = {}
    search_works = True
    try:
        for first in range(0, len(pages), CRAWL_TABS):
            batch = list(zip(tabs, pages[first:first + CRAWL_TABS], strict=False))
            started = []
            for (page, watch), path in batch:
                watch.current = "/" + path
                try:
                    page.goto(base_url + path, wait_until="commit")
                    started.append((page, watch))
                except PlaywrightError as e:
                    watch.problems.append((watch.current, f"did not load: {e}"))
            for page, watch in started:
                try:
                    page.wait_for_load_state("load")
                except PlaywrightError as e:
                    watch.problems.append((watch.current, f"did not load: {e}"))
                    continue
                if search_works:
                    # The search worker fetches the index after "load": wait until it has
                    # indexed it, so that its failures are this page's. Where it never
                    # does, say so once, and do not wait for it on every later page.
                    try:
                        _wait_search_ready(page)
                    except PlaywrightError:
                        search_works = False
                        watch.problems.append((watch.current, (
                            f"the search was still 'Initializing search' after "
                            f"{TIMEOUT_MS // 1000} s (its index did not load); not waited "
                            f"for on the pages after this one")))
                # Requests the page makes after "load" (its favicon) must be over before
                # the tab moves on: the next navigation would cancel them (ERR_ABORTED),
                # which says nothing about the site.
                try:
                    page.wait_for_load_state("networkidle")
                except PlaywrightError as e:
                    watch.problems.append((watch.current, f"requests still running: {e}"))
                links[watch.current] = [
                    (str(href), str(resolved)) for href, resolved in page.eval_on_selector_all(
                        "a[href]", "els => els.map(a => [a.getAttribute('href'), a.href])")]
        order = {"/" + path: i for i, path in enumerate(pages)}
        problems = sorted((p for _, watch in tabs for p in watch.problems),
                          key=lambda p: order.get(p[0], -1))
        yield _Crawl(["/" + path for path in pages], problems, links)
    finally:
        for page, _ in tabs:
            page.context.close()


# -- link checking helpers -------------------------------------------------------------------

class _Anchors(html.parser.HTMLParser):
    """The ids of an HTML file's elements and the names of its <a name=...>."""

    def __init__(self) -> None:
        super().__init__()
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if value is not None and (key == "id" or (key == "name" and tag == "a")):
                self.anchors.add(value)


def _anchors(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    if path not in cache:
        parser = _Anchors()
        parser.feed(path.read_text(encoding="utf-8"))
        cache[path] = parser.anchors
    return cache[path]


def _site_file(site_dir: Path, url_path: str) -> Path | None:
    """The file the server answers a URL path with (a directory gives its index.html), or
    None where there is none."""
    rel = unquote(url_path).lstrip("/")
    target = (site_dir / rel).resolve()
    if not target.is_relative_to(site_dir):
        return None
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


# -- the tests -------------------------------------------------------------------------------

def test_every_page_loads_without_errors(crawl: _Crawl) -> None:
    """Each page: no console error, no uncaught exception, no failed same-origin request."""
    assert "/" in crawl.pages and len(crawl.pages) > 1, f"too few pages found: {crawl.pages}"
    if crawl.problems:
        pytest.fail(f"{len(crawl.problems)} problems (page: problem):\n" + "\n".join(
            f"  {page}: {problem}" for page, problem in crawl.problems), pytrace=False)


def test_no_broken_links(crawl: _Crawl, site_dir: Path, base_url: str) -> None:
    """Each <a href> of each rendered page: a same-origin target exists, and so does its
    #anchor; no link points at a local server; other origins are not fetched."""
    assert crawl.links, "no page was rendered"
    origin = urlsplit(base_url).netloc
    broken: dict[str, None] = {}  # (an ordered set: a link repeated on a page counts once)
    external: set[str] = set()
    anchors: dict[Path, set[str]] = {}
    for page, links in crawl.links.items():
        for href, resolved in links:
            parts = urlsplit(resolved)
            if parts.scheme in ("http", "https") and parts.netloc == origin:
                target = _site_file(site_dir, parts.path)
                fragment = unquote(parts.fragment)
                if target is None:
                    broken[f"  {page} -> {href} (no such file)"] = None
                elif (fragment and target.suffix == ".html"
                      and fragment not in _anchors(target, anchors)):
                    broken[f"  {page} -> {href} (no #{fragment} in "
                           f"{target.relative_to(site_dir).as_posix()})"] = None
            elif parts.scheme in ("http", "https"):
                host = (parts.hostname or "").lower()
                if host in LOCAL_HOSTS or host.startswith("127."):
                    broken[f"  {page} -> {href} (points at a local server)"] = None
                external.add(resolved)
            elif parts.scheme == "mailto":
                external.add(resolved)
            elif parts.scheme == "file":
                broken[f"  {page} -> {href} (a file: URL)"] = None
    if broken:
        pytest.fail(f"{len(broken)} broken links (page -> href):\n" + "\n".join(broken),
                    pytrace=False)


def test_navigation(page: Page, base_url: str) -> None:
    """The sidebar's links lead to their pages, a top-level one and one in a section."""
    page.goto(base_url, wait_until="load")
    primary = page.get_by_role("navigation", name="Navigation", exact=True)
    primary.get_by_role("link", name="Getting started", exact=True).click()
    page.wait_for_url(base_url + "getting-started/")
    assert _h1(page) == "Getting started"

    section = page.get_by_role("navigation", name="API reference", exact=True)
    section.get_by_role("link", name="Calls and workers", exact=True).click()
    page.wait_for_url(base_url + "reference/rpc/")
    assert _h1(page) == "Calls and workers"


def test_search_finds_a_name(page: Page, base_url: str, site_dir: Path) -> None:
    """Searching for ``rpc_sync`` lists results on the site; one of them opens its page."""
    page.goto(base_url, wait_until="load")
    _open_search(page)
    page.locator("input.md-search__input").press_sequentially("rpc_sync")
    items = page.locator(".md-search-result__item")
    expect(items.first).to_be_visible(timeout=TIMEOUT_MS)
    expect(page.locator(".md-search-result__meta")).to_have_text(
        re.compile(r"\d+ matching documents?"), timeout=TIMEOUT_MS)

    # Each result's own links (those to a page's further sections fold into <details>).
    links = page.locator(".md-search-result__item > a.md-search-result__link")
    hrefs = [str(h) for h in links.evaluate_all("els => els.map(a => a.href)")]
    origin = urlsplit(base_url).netloc
    assert hrefs and all(urlsplit(h).netloc == origin for h in hrefs), hrefs
    assert all(_site_file(site_dir, urlsplit(h).path) for h in hrefs), hrefs
    # Follow a result on another page than this one, so that following it is a navigation.
    # Chosen and clicked in one step in the page: the theme replaces the list as each
    # typed letter's results come in, so a link read first and clicked after may be gone.
    clicked = page.evaluate("""() => {
        const links = [...document.querySelectorAll(
            '.md-search-result__item > a.md-search-result__link')];
        const link = links.find(a => new URL(a.href).pathname !== '/');
        if (!link) return null;
        link.click();
        return link.href;
    }""")
    assert clicked, f"every result for rpc_sync is on the home page: {hrefs}"
    target = urlsplit(str(clicked)).path
    page.wait_for_url(lambda url: urlsplit(url).path == target)
    expect(page.locator(".md-content")).to_contain_text("rpc_sync", timeout=TIMEOUT_MS)


def test_search_without_results(page: Page, base_url: str) -> None:
    """Searching for a word in no page shows the theme's "No matching documents"."""
    page.goto(base_url, wait_until="load")
    _open_search(page)
    page.locator("input.md-search__input").press_sequentially("qzxvjkwpfh")
    expect(page.locator(".md-search-result__meta")).to_have_text(
        re.compile(r"no matching documents", re.IGNORECASE), timeout=TIMEOUT_MS)
    assert page.locator(".md-search-result__item").count() == 0


def _reference_objects(markdown: str) -> list[str]:
    """The identifiers a reference page's ``::: object`` blocks render: each object, and
    each name of its ``members:`` option as ``object.name``."""
    found: list[str] = []
    current: str | None = None
    in_members = False
    for line in markdown.splitlines():
        stripped = line.strip()
        directive = re.match(r":::\s+(\S+)", line)
        if directive:
            current, in_members = directive.group(1), False
            found.append(current)
        elif current is None or not stripped:
            continue
        elif not line[0].isspace():
            current = None
        elif stripped.startswith("members:"):
            inline = re.match(r"members:\s*\[(.*)\]", stripped)
            found += [f"{current}.{name.strip()}" for name in (inline.group(1).split(",")
                                                                 if inline else ())]
            in_members = inline is None and stripped == "members:"
        elif in_members and stripped.startswith("- "):
            found.append(f"{current}.{stripped[2:].strip()}")
        else:
            in_members = False
    return found


def _docstring_summary(source: Path, name: str) -> str:
    """The first paragraph of function ``name``'s docstring in ``source``, as rendered text
    (reST's backquotes dropped, whitespace collapsed)."""
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            doc = ast.get_docstring(node) or ""
            return " ".join(doc.split("\n\n")[0].replace("`", "").split())
    raise AssertionError(f"no function {name} in {source}")


def test_api_reference_renders_objects(page: Page, base_url: str) -> None:
    """Every object docs/reference/ names (``::: object`` and its ``members:``) renders as a
    heading with that id, and rpcx.api.init_rpc shows its docstring."""
    missing: list[str] = []
    pages = 0
    for md in sorted((ROOT / "docs" / "reference").glob("*.md")):
        objects = _reference_objects(md.read_text(encoding="utf-8"))
        if not objects:
            continue
        pages += 1
        path = "reference/" + ("" if md.stem == "index" else md.stem + "/")
        page.goto(base_url + path, wait_until="load")
        absent = page.evaluate(
            "ids => ids.filter(id => !document.getElementById(id)"
            "?.classList.contains('doc-heading'))", objects)
        missing += [f"  /{path}: {name}" for name in absent]
        if not page.locator(".doc-contents").filter(has_text=re.compile(r"\S")).count():
            missing.append(f"  /{path}: no object has any documentation text")
    assert pages, "no ::: object in docs/reference/*.md"
    if missing:
        pytest.fail("objects docs/reference/ names that the site does not render "
                    "(page: object):\n" + "\n".join(missing), pytrace=False)

    page.goto(base_url + "reference/rpc/", wait_until="load")
    summary = _docstring_summary(ROOT / "rpcx" / "api.py", "init_rpc")
    assert summary, "rpcx.api.init_rpc has no docstring"
    rendered = page.evaluate(
        "id => document.getElementById(id)?.parentElement"
        ".querySelector(':scope > .doc-contents')?.innerText ?? null", "rpcx.api.init_rpc")
    assert rendered is not None, "no docstring rendered under rpcx.api.init_rpc"
    assert summary in " ".join(str(rendered).split()), (summary, rendered)


LAPTOP = {"width": 1366, "height": 768}  # a common laptop screen
# The text of each element matched by the selector that is wider than its box (it
# scrolls sideways, or is cut off).
OVERFLOWING_JS = """selector => [...document.querySelectorAll(selector)]
    .filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => e.textContent.trim().slice(0, 80))"""


def test_signatures_fit_their_column(page: Page, base_url: str) -> None:
    """Long signatures are laid out one parameter a line (mkdocstrings, with ruff), not
    left to run off the column at a laptop's width."""
    page.set_viewport_size(LAPTOP)
    for path in ("reference/rpc/", "reference/options/", "reference/rref/",
                 "reference/training/"):
        page.goto(base_url + path, wait_until="load")
        assert page.locator(".doc-signature").count() > 0, path
        overflowing = page.evaluate(OVERFLOWING_JS, ".doc-signature pre, .doc-signature code")
        assert overflowing == [], f"{path}: {overflowing}"


# Each code block of the page that is wider than its box at this width (it scrolls
# sideways): the first line that does not fit, its width and the room there is. A line
# is measured in a span of the block's own font; room is the block's width less its
# padding (Chromium counts the right padding in what scrolls).
CODE_OVERFLOW_JS = """() => {
    const blocks = new Set();
    for (const e of document.querySelectorAll(
            '.md-content pre, .md-content pre > code, .md-content div.highlight')) {
        if (e.scrollWidth > e.clientWidth + 1) {
            blocks.add(e.matches('code') ? e : (e.querySelector('pre > code') ?? e));
        }
    }
    return [...blocks].map(block => {
        const style = getComputedStyle(block);
        const room = block.clientWidth - parseFloat(style.paddingLeft)
            - parseFloat(style.paddingRight);
        const lines = block.textContent.replace(/\\n$/, '').split('\\n');
        const probe = document.createElement('span');
        probe.style.whiteSpace = 'pre';
        block.appendChild(probe);
        let first = null;
        let widest = {line: 0, width: -1, text: ''};
        lines.forEach((text, i) => {
            probe.textContent = text;
            const width = probe.getBoundingClientRect().width;
            const measured = {line: i + 1, width: width, text: text};
            if (first === null && width > room + 1) first = measured;
            if (width > widest.width) widest = measured;
        });
        probe.remove();
        return {...(first ?? widest), room: room, lines: lines.length,
                block: lines[0].slice(0, 40)};
    });
}"""


def test_code_blocks_fit_their_column(page: Page, base_url: str, site_dir: Path) -> None:
    """At a laptop's width no code block of any page scrolls sideways: every line of
    code, output and sample fits the column (80 characters of the theme's monospace:
    tests/test_doc_widths.py holds the Markdown to that)."""
    page.set_viewport_size(LAPTOP)
    pages = _site_pages(site_dir)
    assert len(pages) > 1, pages
    found = []
    for path in pages:
        page.goto(base_url + path, wait_until="load")
        for block in page.evaluate(CODE_OVERFLOW_JS):
            found.append(
                f"  /{path}: line {block['line']} of {block['lines']} of the block "
                f"starting {block['block']!r} is {block['width']:.0f} px wide, the column "
                f"{block['room']:.0f} px:\n    {block['text']}")
    if found:
        pytest.fail(f"{len(found)} code blocks wider than the column at "
                    f"{LAPTOP['width']} px (page: first line that does not fit):\n"
                    + "\n".join(found), pytrace=False)


def test_first_pages_are_kept_as_screenshots(page: Page, base_url: str) -> None:
    """The home and getting-started pages at a laptop's width, kept under
    ``build/screenshots/`` for a person to look at (CI keeps the build directory)."""
    page.set_viewport_size(LAPTOP)
    out = ROOT / "build" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    for path, name in (("", "home"), ("getting-started/", "getting-started")):
        page.goto(base_url + path, wait_until="load")
        shot = out / f"{name}.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000, shot  # (a blank page is a few KiB)
