"""The playground page (``specdec serve``'s ``/``) in a real browser: Debian's chromium driven by
Playwright, against a real gateway and a real verifier on the tiny pair. Skipped, with the
reason, where chromium or Playwright is missing (``make test`` installs chromium as root)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from drafter_client.api import SpecDecClient
from drafter_client.gateway import GatewaySettings, create_gateway
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.prometheus import scrape, wait_for_idle
from tests.support.servers import ThreadedServer
from tests.support.tiny_models import save_parrot

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed")
expect = sync_api.expect
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (make test installs it as root)",
                allow_module_level=True)

pytestmark = pytest.mark.browser
MODEL = "tiny-gpt2"
SCRIPT = "<script>alert(1)</script>"


# -- servers and the browser ----------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: the suite may run as root, where chromium's sandbox refuses to start
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


def open_page(browser: Any, url: str, width: int = 1280, height: int = 800) -> Any:
    """The page, loaded, with its script errors collected in ``page.errors``. Its
    Content-Security-Policy holds (the waits below poll from Python: it forbids eval)."""
    page = browser.new_context(viewport={"width": width, "height": height}).new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.goto(url)
    expect(page.locator("#about")).not_to_have_text("connecting...")
    return page


def ask(page: Any, prompt: str, press: str = "Enter") -> Any:
    """Type ``prompt``, send it with the keyboard, and wait for the stream to end: the turn's
    answer element."""
    turns = page.locator(".answer").count()
    page.fill("#prompt", prompt)
    page.press("#prompt", press)
    answer = page.locator(".answer").nth(turns)
    expect(answer).to_have_attribute("data-done", re.compile(".+"), timeout=60_000)
    return answer


def text_of(element: Any) -> str:
    return element.evaluate("e => e.textContent")  # type: ignore[no-any-return]


# -- the tests --------------------------------------------------------------------------------

def test_the_page_answers_as_the_api_does(browser: Any, gateway: ThreadedServer) -> None:
    """Greedy chat through the page equals the official client's answer to the same request,
    turn after turn (the page keeps the conversation); one coloured span per completion token,
    blocks with their k and accepted count on hover, and the live figures filled in."""
    page = open_page(browser, gateway.url)
    assert page.input_value("#k") == "auto" and page.input_value("#temperature") == "0"
    page.fill("#k", "4")
    page.fill("#max-tokens", "24")
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, str]] = []
    for prompt in ("the cat sat on", "def f ( x ) :"):
        answer = ask(page, prompt)
        assert answer.get_attribute("data-done") in ("stop", "length")
        messages.append({"role": "user", "content": prompt})
        api = oai.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          temperature=0, max_tokens=24, seed=0)
        assert text_of(answer) == api.choices[0].message.content
        assert answer.locator(".tok").count() == api.usage.completion_tokens  # type: ignore[union-attr]
        messages.append({"role": "assistant", "content": api.choices[0].message.content or ""})
        kinds = set(answer.locator(".tok").evaluate_all("ts => ts.map(t => t.className)"))
        assert kinds <= {"tok accepted", "tok recovered", "tok bonus", "tok target"}
        assert "tok accepted" in kinds  # k = 4 on a drafter close to its target
    blocks = answer.locator(".block")
    assert 1 < blocks.count() <= answer.locator(".tok").count()
    blocks.first.hover()
    assert re.fullmatch(r"block 1: k \d, accepted \d, round trip [\d.]+ ms \(verifier [\d.]+ ms\)",
                        page.text_content("#hover"))
    assert float(page.text_content("#fig-rate")) > 0
    assert int(page.text_content("#fig-tokens")) == answer.locator(".tok").count()
    assert int(page.text_content("#fig-calls")) == blocks.count()
    assert re.fullmatch(r"\d+\.\d%", page.text_content("#fig-acceptance"))
    assert page.errors == []


def test_the_prediction_and_schema_boxes(browser: Any, gateway: ThreadedServer) -> None:
    """A prediction (the API's own answer) leaves the answer the API's and shows how many of
    its drafted tokens the target accepted; a schema box that is not JSON is the page's own
    error, and a schema the engine refuses is the gateway's 400, shown."""
    page = open_page(browser, gateway.url)
    page.fill("#max-tokens", "24")
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    api = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, seed=0,
                                      messages=[{"role": "user", "content": "the cat sat on"}])
    expected = api.choices[0].message.content or ""
    page.fill("#prediction", expected)
    answer = ask(page, "the cat sat on")
    assert text_of(answer) == expected
    assert re.fullmatch(r"[1-9]\d* of \d+ drafted", page.text_content("#fig-prediction"))
    page.click("#reset")
    page.fill("#prediction", "")
    page.fill("#schema", "{not json")
    page.fill("#prompt", "the dog")
    page.press("#prompt", "Enter")
    expect(page.locator("#error")).to_contain_text("JSON schema: not JSON")
    page.fill("#schema", '{"type": "nonsense"}')
    page.fill("#prompt", "the dog")
    page.press("#prompt", "Enter")
    expect(page.locator("#error")).to_contain_text("response_format")
    assert page.errors == []


def test_completion_mode_answers_as_the_api_does(browser: Any, gateway: ThreadedServer) -> None:
    """Plain completion: the prompt as it is, continued; sampled with the page's seed, as the
    API samples the same request."""
    page = open_page(browser, gateway.url)
    page.select_option("#mode", "completion")
    page.fill("#temperature", "0.8")
    page.fill("#seed", "7")
    page.fill("#max-tokens", "16")
    answer = ask(page, "def f ( x ) :")
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    api = oai.completions.create(model=MODEL, prompt="def f ( x ) :", temperature=0.8,
                                 max_tokens=16, seed=7)
    assert text_of(answer) == api.choices[0].text
    assert answer.locator(".tok").count() == api.usage.completion_tokens  # type: ignore[union-attr]
    assert page.errors == []


def test_the_race(browser: Any, gateway: ThreadedServer) -> None:
    """The race runs the request again with the target alone and shows both times, the
    speedup and that the greedy outputs are identical; the page's comparison finds where
    two texts differ (its negative control)."""
    page = open_page(browser, gateway.url)
    page.fill("#max-tokens", "20")
    page.fill("#prompt", "the dog ran to")
    page.click("#race")
    expect(page.locator("#race-speedup")).to_have_text(re.compile(r"^\d+\.\d\dx$"),
                                                       timeout=60_000)
    assert re.fullmatch(r"[\d.]+ s, \d+ tokens", page.text_content("#race-spec"))
    assert re.fullmatch(r"[\d.]+ s, \d+ tokens", page.text_content("#race-target"))
    assert page.text_content("#race-identical") == "identical"
    assert page.text_content("#race-text") == text_of(page.locator(".answer").last)
    assert page.evaluate("identity('the cat', 'the dog')") == "differ from character 4"
    assert page.evaluate("identity('the cat', 'the cat')") == "identical"
    assert page.errors == []


def test_enter_sends_and_shift_enter_breaks_the_line(browser: Any,
                                                      gateway: ThreadedServer) -> None:
    page = open_page(browser, gateway.url)
    page.fill("#prompt", "the")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "cat")
    assert page.input_value("#prompt") == "the\ncat"
    assert page.locator(".answer").count() == 0
    page.fill("#max-tokens", "4")
    answer = ask(page, "the cat")
    assert answer.locator(".tok").count() >= 1 and page.input_value("#prompt") == ""


def test_stop_cancels_the_generation_on_the_gateway(browser: Any, gpt2_server: LiveServer,
                                                    tiny_models: dict[str, Path]) -> None:
    """Stop ends the stream; the gateway stops generating at its next block and closes the
    verifier session. A 150 ms round trip makes the 200-token answer take 10 s at least (67
    blocks of at most 3 tokens), so it cannot end by itself before Stop on a loaded machine (CI
    once saw a 40 ms one finish first)."""
    client = SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-drafter"]),
                           simulated_rtt_ms=150)
    with ThreadedServer(create_gateway(client, GatewaySettings(MODEL))) as slow:
        page = open_page(browser, slow.url)
        page.fill("#max-tokens", "200")
        page.fill("#k", "2")
        page.fill("#prompt", "the cat")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".answer .tok")
        assert page.is_enabled("#stop") and not page.is_enabled("#send")
        page.click("#stop")
        page.wait_for_selector(".answer[data-done]")
        assert page.get_attribute(".answer", "data-done") == "stopped"
        assert page.is_enabled("#send") and page.locator("#error").is_hidden()
        wait_for_idle(slow.url, gpt2_server.url)
        generated = scrape(slow.url)["specdec_gateway_generated_tokens_total"][()]
        assert 0 < generated < 200  # it stopped: uncancelled, it would have made all 200


def safe_transcript(page: Any) -> bool:
    """Nothing in the transcript but the page's own text containers (no script, image, link
    or any element that model output could have become)."""
    tags = page.evaluate("[...document.querySelectorAll('#transcript *')].map(e => e.tagName)")
    return set(tags) <= {"DIV", "SPAN"} and page.locator("script").count() == 1


def test_model_output_is_inserted_as_text(browser: Any, tmp_path: Path) -> None:
    """A target that answers ``<script>alert(1)</script>`` (the parrot, over the official
    client too): the page shows it as text; no script element, no dialog. The negative
    control: the same text inserted as HTML is caught by the same check."""
    parrot = save_parrot(tmp_path / "parrot", SCRIPT)
    with (LiveServer(fp32_settings(parrot, max_draft_tokens=4)) as verifier,
          ThreadedServer(create_gateway(SpecDecClient(verifier.url, str(parrot)),
                                        GatewaySettings("parrot"))) as gw):
        page = open_page(browser, gw.url)
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.fill("#max-tokens", "3")
        answer = ask(page, f"echo {SCRIPT}")
        oai = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        api = oai.chat.completions.create(
            model="parrot", messages=[{"role": "user", "content": f"echo {SCRIPT}"}],
            temperature=0, max_tokens=3, seed=0)
        assert text_of(answer) == api.choices[0].message.content == " ".join([SCRIPT] * 3)
        assert text_of(page.locator(".user").last) == f"echo {SCRIPT}"
        assert safe_transcript(page) and dialogs == [] and page.errors == []
        page.evaluate("document.querySelector('.answer').innerHTML = "
                      "document.querySelector('.answer').textContent")
        assert not safe_transcript(page)


def test_a_wrong_api_key_shows_the_gateways_error(browser: Any, gpt2_server: LiveServer,
                                                  tiny_models: dict[str, Path]) -> None:
    client = SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-drafter"]))
    with ThreadedServer(create_gateway(client, GatewaySettings(MODEL, api_key="sesame"))) as gw:
        page = open_page(browser, gw.url)  # no key yet: the settings call is refused
        assert page.locator("#error").is_visible()
        assert page.text_content("#error").startswith("401: invalid or missing API key")
        page.fill("#api-key", "sesame")
        page.dispatch_event("#api-key", "change")
        page.wait_for_selector("#error", state="hidden")
        page.fill("#max-tokens", "4")
        assert ask(page, "the cat").get_attribute("data-done") in ("stop", "length")
        page.fill("#api-key", "wrong")  # the page has the settings; the completion is refused
        page.dispatch_event("#api-key", "change")
        page.wait_for_selector("#error", state="visible")
        page.fill("#prompt", "the dog")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".answer[data-done='error']", state="attached")
        assert page.text_content("#error").startswith("401: invalid or missing API key")
        assert page.is_enabled("#send")


# -- closed to other sites (issue #57) -------------------------------------------------------

# A page on another origin tries what a web page can: "simple" requests (no preflight, sent
# blind in no-cors mode: text/plain, a Blob without a type, a form) and a JSON request (which
# needs a CORS preflight the gateway does not grant).
ATTACK = """<!doctype html><title>elsewhere</title><script>
const body = JSON.stringify({model: "%s", messages: [{role: "user", content: "the cat"}],
                             max_tokens: 4, temperature: 0});
const tries = [
  ["text", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body}],
  ["blob", {method: "POST", mode: "no-cors", body: new Blob([body])}],
  ["form", {method: "POST", mode: "no-cors", body: new URLSearchParams({[body]: ""})}],
  ["json", {method: "POST", headers: {"Content-Type": "application/json"}, body}],
];
(async () => {
  const results = [];
  for (const [name, init] of tries) {
    try {
      const answer = await fetch("%s/v1/chat/completions", init);
      results.push(name + " " + answer.type + " " + answer.status);
    } catch (error) {
      results.push(name + " refused");
    }
  }
  window.results = results;
})();
</script>"""


def work(gateway: ThreadedServer) -> tuple[float, float]:
    samples = scrape(gateway.url)
    return (samples["specdec_gateway_prompt_tokens_total"][()],
            samples["specdec_gateway_generated_tokens_total"][()])


def test_a_page_on_another_origin_cannot_drive_the_gateway(browser: Any,
                                                           gateway: ThreadedServer) -> None:
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    page_html = ATTACK % (MODEL, gateway.url)
    elsewhere = Starlette(routes=[Route("/", lambda _: HTMLResponse(page_html))])
    before = work(gateway)
    with ThreadedServer(elsewhere) as site:
        page = browser.new_context().new_page()
        page.goto(site.url)
        page.wait_for_function("window.results !== undefined", timeout=60_000)
        results = page.evaluate("window.results")
    # the blind ones were sent (an opaque answer) and refused; the JSON one never left
    assert results == ["text opaque 0", "blob opaque 0", "form opaque 0", "json refused"]
    assert work(gateway) == before  # nothing generated for any of them


def test_a_rebound_name_is_refused_and_the_page_works_by_its_own(
        browser: Any, gateway: ThreadedServer) -> None:
    """DNS rebinding: a name the attacker controls resolves to 127.0.0.1 (here by the
    browser's resolver rules); the gateway refuses the page and the API under that name. The
    playground under localhost still works (its own origin)."""
    rebinding = browser.browser_type.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--host-resolver-rules=MAP rebound.test 127.0.0.1"])
    try:
        page = rebinding.new_context().new_page()
        answer = page.goto(f"http://rebound.test:{gateway.port}/")
        assert answer is not None and answer.status == 421
        assert "DNS rebinding" in page.content()
        page = open_page(rebinding, f"http://localhost:{gateway.port}/")
        page.fill("#max-tokens", "4")
        assert ask(page, "the cat").get_attribute("data-done") in ("stop", "length")
        assert page.errors == []
    finally:
        rebinding.close()


@pytest.mark.parametrize(("width", "height"), [(1280, 800), (390, 844)])
def test_the_page_fits_desktop_and_phone(browser: Any, gateway: ThreadedServer, width: int,
                                         height: int) -> None:
    """No sideways scrolling; the prompt and its buttons within the width."""
    page = open_page(browser, gateway.url, width, height)
    page.fill("#max-tokens", "40")
    ask(page, "the cat sat on the mat")
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    for selector in ("#prompt", "#send", "#race", "#stop", "#transcript", "#figures"):
        box = page.locator(selector).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, selector
