"""A screenshot of the playground page after a race on a running gateway (docs/playground.png).

    python scripts/playground_shot.py --gateway-url http://127.0.0.1:8080 \
        --prompt "Write a Python function that checks whether a number is prime." \
        --out docs/playground.png

Drives Debian's chromium with Playwright at 1280x800: types the prompt, presses Race (the
speculative answer streamed and coloured, then the target alone), hovers the block with the
most accepted drafts, and saves the page. Prints the race's figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys

from playwright.sync_api import expect, sync_playwright


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway-url", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", default=None, help="the page's k policy (default: the gateway's)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--out", default="docs/playground.png")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        page.goto(args.gateway_url)
        if args.api_key:
            page.fill("#api-key", args.api_key)
            page.dispatch_event("#api-key", "change")
        expect(page.locator("#about")).not_to_have_text("connecting...")
        page.fill("#max-tokens", str(args.max_tokens))
        if args.k is not None:
            page.fill("#k", args.k)
        page.fill("#prompt", args.prompt)
        page.click("#race")
        expect(page.locator("#race-speedup")).to_have_text(re.compile(r"^\d+\.\d\dx$"),
                                                           timeout=args.timeout_s * 1000)
        accepted = page.locator(".block").evaluate_all(
            "bs => bs.map(b => Number(b.dataset.accepted))")
        if accepted:
            page.locator(".block").nth(accepted.index(max(accepted))).hover()
        page.screenshot(path=args.out, full_page=True)
        figures = {name: page.text_content(f"#{name}") for name in (
            "race-spec", "race-target", "race-speedup", "race-identical", "fig-rate",
            "fig-acceptance", "fig-mean", "fig-calls", "hover")}
        browser.close()
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
