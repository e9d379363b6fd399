"""The demo page at ``GET /``, driven in a real headless Chromium (Debian's ``chromium``
package through Playwright's Python API; no browser is downloaded) against a real gateway,
a real worker and a real redis-server.

A model with a chat template (tiny-gpt's is ``builtin``) chats: the tests check that each
message goes out as ``messages`` with the conversation's earlier turns (a stopped reply as
it was shown), that "New conversation" forgets them, that the history limit leaves the
oldest exchanges out and says so, and that a model's raw completion is still one click away.

The microphone test gives Chromium a fake microphone that plays a WAV of flite speech
(``--use-file-for-fake-audio-capture``) and checks the transcript the page shows.

The browser tests skip, saying why, when Playwright or a ``chromium`` executable is not
installed (the microphone test also without ``flite``); the plain HTTP test of the page's
files always runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from streamfleet.devkit.speech import SENTENCES, flite_missing, silence, speech, wer, write_wav

try:
    from playwright.sync_api import expect
except ImportError:  # the browser tests skip (see the launch fixture)
    expect = None

pytestmark = pytest.mark.slow  # a real headless Chromium

DEMO_SCREENSHOT = Path("/tmp/streamfleet-demo.png")
#: the echo engine's step time: 200 tokens take about 5 s, so Stop always lands mid-stream
#: (tiny-gpt itself writes 200 tokens in well under a second on a CPU, too fast to stop reliably)
ECHO_DELAY_MS = 25
#: what the fake microphone says (flite); nothing after it: the file is played once
#: what the fake microphone says: two sentences, so two utterances (and enough words that
#: one misheard word pair, like "fair enough" for "turn off", stays within the WER bound)
MIC_SENTENCES = (SENTENCES[0], SENTENCES[4])


def _chromium() -> str | None:
    for candidate in (os.environ.get("SF_TEST_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def launch():
    """Launches a headless Chromium with the given command-line flags (besides --no-sandbox
    and fake media devices).
    One Playwright for the module's browsers: a second sync Playwright cannot start beside it."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install 'playwright>=1.48')")
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium executable (Debian: apt-get install chromium)")
    expect.set_options(timeout=20_000)
    with sync_playwright() as pw:
        yield lambda *args: pw.chromium.launch(executable_path=executable, headless=True,
                                               args=["--no-sandbox", "--use-fake-device-for-media-stream", *args])


@pytest.fixture(scope="module")
def browser(launch):
    b = launch()
    yield b
    b.close()


@pytest.fixture(scope="module")
def mic_browser(launch, tmp_path_factory):
    """A Chromium whose microphone, once opened, says MIC_SENTENCES: 2 s of silence, each
    sentence followed by 1.5 s of silence, then silence for good (``%noloop``: Chromium would otherwise
    play the file over and over). The file plays from the moment the capture opens, and the
    page hears it only once its AudioWorklet is connected, a moment later (more on a busy
    machine: with 0.5 s of lead-in the suite's load cut "turn off" to "fair enough"). The
    file is 16 kHz; the page's AudioContext runs at the fake device's rate (44.1 kHz with
    this Chromium), so the page's resampler is in the path."""
    if flite_missing():
        pytest.skip(flite_missing())
    wav = write_wav(tmp_path_factory.mktemp("mic") / "speech.wav",
                    silence(2000) + b"".join(speech(s) + silence(1500) for s in MIC_SENTENCES))
    b = launch("--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={wav}%noloop")
    yield b
    b.close()


class PageWatch:
    """A page with everything it does recorded: requests, WebSocket frames, script errors."""

    def __init__(self, browser, origin: str, permissions: tuple[str, ...] = ()) -> None:
        self.origin = origin
        self.context = browser.new_context(viewport={"width": 1100, "height": 860}, permissions=list(permissions))
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.requests: list[str] = []
        self.websockets: list[str] = []
        self.sent: list[dict] = []
        self.received: list[dict] = []
        self.audio_sent: list[int] = []  # the size of each binary frame sent
        # each WebSocket path's frames in order: {"/v1/audio/stream": ["sent:start", "received:started", ...]}
        self.timelines: dict[str, list[str]] = {}
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", self._on_console)
        self.page.on("websocket", self._on_ws)

    def _on_console(self, msg) -> None:
        # a failed load is the browser's own note (e.g. no /v1/models yet: the page falls back)
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            self.errors.append(msg.text)

    def _on_ws(self, ws) -> None:
        self.websockets.append(ws.url)
        timeline = self.timelines.setdefault(urlsplit(ws.url).path, [])
        ws.on("framesent", lambda payload: self._on_frame(timeline, "sent", self.sent, payload))
        ws.on("framereceived", lambda payload: self._on_frame(timeline, "received", self.received, payload))

    def _on_frame(self, timeline: list[str], direction: str, frames: list[dict], payload: str | bytes) -> None:
        if isinstance(payload, bytes):  # audio: the voice socket's binary frames
            if direction == "sent":
                self.audio_sent.append(len(payload))
            timeline.append(f"{direction}:audio")
            return
        frame = json.loads(payload)
        frames.append(frame)
        timeline.append(f"{direction}:{frame.get('type')}")

    def open(self) -> None:
        self.page.goto(self.origin + "/")
        self.page.wait_for_selector("#conn[data-state=open]")       # the WebSocket is up
        self.page.wait_for_selector("#model[data-loaded]", state="attached")  # /v1/models answered (or failed)
        self.page.wait_for_selector("#model option[value=tiny-gpt]", state="attached")

    def assert_same_origin_only(self) -> None:
        ws_origin = self.origin.replace("http://", "ws://", 1)
        assert self.requests and all(u.startswith(self.origin + "/") for u in self.requests), self.requests
        assert self.websockets and all(u.startswith((ws_origin + "/v1/stream", ws_origin + "/v1/audio/stream"))
                                       for u in self.websockets), self.websockets

    def close(self) -> None:
        self.context.close()


def test_page_files_are_served(fleet):
    gw = fleet.gateway()
    with httpx.Client(base_url=gw.http) as http:
        r = http.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        for element_id in ("prompt", "model", "priority", "max-tokens", "temperature", "generate", "stop",
                           "output", "status", "ttft", "tps", "error", "ignore-eos", "chat", "new-chat",
                           "conversation", "history-chars", "history-note",
                           "mic", "voice-status", "voice-error", "partial", "finals"):
            assert f'id="{element_id}"' in r.text
        assert "http://" not in r.text and "https://" not in r.text  # nothing from elsewhere
        for script in ("/static/app.js", "/static/mic-worklet.js"):
            js = http.get(script)
            assert js.status_code == 200 and "javascript" in js.headers["content-type"], script
        assert "registerProcessor(" in http.get("/static/mic-worklet.js").text
        css = http.get("/static/style.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        for bad in ("/static/nope.js", "/static/..%2Fdemo.py", "/static/%2e%2e%2fdemo.py", "/static/../demo.py",
                    "/static/.%2E/__init__.py"):
            assert http.get(bad).status_code == 404, bad


def test_generate_stream_and_stop(fleet, browser, tmp_path):
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=ECHO_DELAY_MS)
    w = PageWatch(browser, gw.http)
    try:
        page = w.page
        w.open()
        assert page.text_content("#status") == "idle"
        assert page.is_disabled("#stop")
        # tiny-gpt has a chat template ("builtin"): the page chats; unchecked, it completes the raw prompt
        assert page.is_checked("#chat") and page.text_content("#chat-template") == "(template: builtin)"
        page.uncheck("#chat")
        assert page.text_content("#generate") == "Generate" and page.is_visible("#output")
        assert page.is_hidden("#conversation") and page.is_hidden("#new-chat")

        page.fill("#prompt", "Once upon a time, a fleet of tiny workers streamed tokens to the world.")
        page.select_option("#model", "tiny-gpt")
        page.select_option("#priority", "high")
        page.fill("#max-tokens", "200")
        page.fill("#temperature", "0.7")
        page.click("#advanced summary")
        page.check("#ignore-eos")
        page.click("#generate")

        # (waits go through locators: the page's CSP forbids the eval behind wait_for_function)
        expect(page.locator("#output")).to_have_text(re.compile(r"\S"))       # tokens arrived
        expect(page.locator("#ttft")).to_have_text(re.compile(r"^\d+(\.\d+)? ms$"))
        expect(page.locator("#status")).to_have_text("streaming")
        assert page.is_disabled("#generate") and page.is_enabled("#stop")
        # let some more tokens in (about a second's worth), so tokens/s has something to measure
        expect(page.locator("#count")).to_have_text(re.compile(r"^([4-9]\d|[1-9]\d{2,})$"))
        page.click("#stop")
        expect(page.locator("#status")).to_have_text("cancelled")

        gen = [f for f in w.sent if f.get("type") == "generate"]
        assert len(gen) == 1
        gen = gen[0]
        assert gen["max_tokens"] == 200 and gen["ignore_eos"] is True and gen["temperature"] == 0.7
        assert gen["priority"] == "high" and gen["model"] == "tiny-gpt" and gen["prompt"].startswith("Once")
        assert {"type": "cancel", "id": gen["id"]} in w.sent
        done = [f for f in w.received if f.get("type") == "done" and f.get("id") == gen["id"]]
        assert len(done) == 1 and done[0]["finish_reason"] == "cancelled"
        tokens = [f for f in w.received if f.get("type") == "token" and f.get("id") == gen["id"]]
        assert 40 <= len(tokens) < 200
        assert done[0]["usage"]["completion_tokens"] == len(tokens)

        assert re.fullmatch(r"\d+(\.\d+)? ms", page.text_content("#ttft")), page.text_content("#ttft")
        assert re.fullmatch(r"\d+(\.\d+)?", page.text_content("#tps")), page.text_content("#tps")
        assert float(page.text_content("#tps")) > 0
        assert page.text_content("#count") == str(len(tokens))
        assert page.text_content("#output") == "".join(t["text"] for t in tokens)
        assert "finish_reason: cancelled" in page.text_content("#usage")
        assert page.is_hidden("#error")
        assert page.is_enabled("#generate") and page.is_disabled("#stop")

        shot = tmp_path / "demo.png"
        page.screenshot(path=str(shot), full_page=True)
        shutil.copyfile(shot, DEMO_SCREENSHOT)

        # chat: a reply stopped mid-stream stays in the conversation as it was shown, and the
        # next message is sent with it
        page.check("#chat")
        assert page.text_content("#generate") == "Send" and page.is_hidden("#output")
        page.fill("#prompt", "Tell me a long story about a fleet of tiny workers.")
        page.click("#generate")
        reply = page.locator("#conversation .turn[data-role=assistant]")
        expect(page.locator("#count")).to_have_text(re.compile(r"^([2-9]\d|[1-9]\d{2,})$"))
        page.click("#stop")
        expect(page.locator("#status")).to_have_text("cancelled")
        expect(reply).to_have_attribute("data-state", "cancelled")
        chat = [f for f in w.sent if f.get("type") == "generate"][1]
        assert "prompt" not in chat and chat["messages"] == [
            {"role": "user", "content": "Tell me a long story about a fleet of tiny workers."}]
        shown = "".join(t["text"] for t in w.received if t.get("type") == "token" and t.get("id") == chat["id"])
        assert shown and reply.locator(".text").text_content() == shown
        assert reply.locator(".meta").text_content().startswith("stopped after ")
        page.fill("#max-tokens", "4")
        page.uncheck("#ignore-eos")
        page.fill("#prompt", "Go on.")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text(re.compile(r"^done: "))
        follow = [f for f in w.sent if f.get("type") == "generate"][2]
        assert follow["messages"] == [
            {"role": "user", "content": "Tell me a long story about a fleet of tiny workers."},
            {"role": "assistant", "content": shown},
            {"role": "user", "content": "Go on."}]
        assert page.locator("#conversation .turn").count() == 4

        w.assert_same_origin_only()
        assert any(u == gw.http + "/v1/models" for u in w.requests), w.requests
        assert not w.errors, w.errors
    finally:
        w.close()


def _generates(w: PageWatch) -> list[dict]:
    return [f for f in w.sent if f.get("type") == "generate"]


def _done(w: PageWatch, request_id: str) -> dict:
    [done] = [f for f in w.received if f.get("type") == "done" and f.get("id") == request_id]
    return done


def _reply(w: PageWatch, request_id: str) -> str:
    return "".join(f["text"] for f in w.received if f.get("type") == "token" and f.get("id") == request_id)


def test_chat_keeps_the_conversation(fleet, browser, tmp_path):
    """The real tiny-gpt, greedy: the second question goes out with the first and its answer
    (the prompt grows accordingly), "New conversation" forgets them, and past the history
    limit the oldest exchange is left out, marked and explained."""
    gw = fleet.gateway()
    fleet.worker()
    w = PageWatch(browser, gw.http)
    try:
        page = w.page
        w.open()
        assert page.is_checked("#chat") and page.text_content("#generate") == "Send"
        assert page.input_value("#prompt") == ""  # the raw-completion example is no question
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "12")
        turns = page.locator("#conversation .turn")

        page.fill("#prompt", "What is the capital of France?")
        page.press("#prompt", "Enter")  # Enter sends a chat message
        expect(page.locator("#status")).to_have_text(re.compile(r"^done: "))
        assert page.input_value("#prompt") == ""
        first = _generates(w)[0]
        assert "prompt" not in first and first["temperature"] == 0
        assert first["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
        answer = _reply(w, first["id"])
        expect(turns).to_have_count(2)
        assert [turns.nth(k).get_attribute("data-role") for k in range(2)] == ["user", "assistant"]
        assert turns.nth(1).locator(".text").text_content() == answer
        assert turns.nth(1).locator(".who").text_content() == "tiny-gpt"

        page.fill("#prompt", "And of Italy?")
        page.click("#generate")
        expect(turns).to_have_count(4)
        expect(page.locator("#status")).to_have_text(re.compile(r"^done: "))
        second = _generates(w)[1]
        assert second["messages"] == [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And of Italy?"}]
        usage1, usage2 = _done(w, first["id"])["usage"], _done(w, second["id"])["usage"]
        # the whole first exchange is in the second prompt
        assert usage2["prompt_tokens"] > usage1["prompt_tokens"] + usage1["completion_tokens"], (usage1, usage2)
        assert f"prompt {usage2['prompt_tokens']} tokens" in page.text_content("#usage")
        assert page.is_hidden("#history-note")
        page.screenshot(path=str(tmp_path / "demo-chat.png"), full_page=True)

        # a new conversation: no turns shown, none sent
        page.click("#new-chat")
        expect(turns).to_have_count(0)
        page.fill("#prompt", "Hello")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text(re.compile(r"^done: "))
        third = _generates(w)[2]
        assert third["messages"] == [{"role": "user", "content": "Hello"}]
        assert _done(w, third["id"])["usage"]["prompt_tokens"] < usage2["prompt_tokens"]
        expect(turns).to_have_count(2)

        # the history limit: the earlier exchange (over 5 characters) no longer fits beside the
        # new message, so it is left out, marked, and the page says so
        page.click("#advanced summary")
        page.fill("#history-chars", str(len("Thanks!") + 2))
        page.fill("#prompt", "Thanks!")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text(re.compile(r"^done: "))
        assert _generates(w)[3]["messages"] == [{"role": "user", "content": "Thanks!"}]
        expect(turns).to_have_count(4)
        assert [turns.nth(k).get_attribute("class") for k in range(4)] == ["turn dropped"] * 2 + ["turn"] * 2
        note = page.locator("#history-note")
        expect(note).to_be_visible()
        expect(note).to_contain_text("2 older turns not sent")
        expect(note).to_contain_text("history limit of 9 characters")
        w.assert_same_origin_only()
        assert not w.errors, w.errors
    finally:
        w.close()


def test_error_frame_is_shown(fleet, browser, tmp_path):
    gw = fleet.gateway()
    fleet.worker(backend="echo")
    w = PageWatch(browser, gw.http)
    try:
        page = w.page
        w.open()
        page.uncheck("#chat")  # a raw completion first
        page.fill("#prompt", "")
        page.click("#generate")
        expect(page.locator("#error")).to_be_visible()
        expect(page.locator("#status")).to_have_text("error")
        box = page.text_content("#error")
        assert "invalid_request" in box and "400" in box and "prompt" in box, box
        assert page.text_content("#output") == ""
        assert page.is_enabled("#generate") and page.is_disabled("#stop")
        page.screenshot(path=str(tmp_path / "demo-error.png"), full_page=True)

        # the socket stayed open: the next request on it streams and clears the error
        page.fill("#prompt", "hello again")
        page.fill("#max-tokens", "8")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text(re.compile(r"^done: "))
        assert page.is_hidden("#error")
        assert page.text_content("#status") == "done: length"
        assert page.text_content("#output")

        # chat: an empty message is not sent; a refused one leaves no turns and goes back
        # into the box; a conversation too long for the model says what to do
        page.check("#chat")
        sent = len(w.sent)
        page.fill("#prompt", "")
        page.click("#generate")
        expect(page.locator("#error")).to_contain_text("type a message first")
        assert len(w.sent) == sent
        page.fill("#prompt", "word " * 400)  # past tiny-gpt's 256-token context
        page.click("#generate")
        expect(page.locator("#status")).to_have_text("error")
        box = page.text_content("#error")
        assert "prompt_too_long" in box and "400" in box and "start a new conversation" in box, box
        assert page.locator("#conversation .turn").count() == 0
        assert page.input_value("#prompt") == "word " * 400
        page.fill("#prompt", "Hello?")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text("done: length")
        assert page.is_hidden("#error")
        assert page.locator("#conversation .turn").count() == 2

        assert len(w.websockets) == 1
        w.assert_same_origin_only()
        assert not w.errors, w.errors
    finally:
        w.close()


def test_rate_limit_reconnect_and_api_key(fleet, browser):
    """Frames the real fleet cannot produce on demand (a 429, a socket that drops mid-stream),
    from a WebSocket the test plays itself; the page is still served by a real gateway."""
    gw = fleet.gateway()
    w = PageWatch(browser, gw.http)
    conns: list[str] = []

    def handler(route) -> None:
        conns.append(route.url)

        def on_message(message) -> None:
            f = json.loads(message)
            if f.get("type") != "generate":
                return
            text = f["prompt"] if "prompt" in f else f["messages"][-1]["content"]
            if text == "flood":
                route.send(json.dumps({"type": "error", "id": f["id"], "code": "rate_limited", "status": 429,
                                       "message": "too many requests for this key", "retry_after_ms": 1500}))
            else:
                route.send(json.dumps({"type": "accepted", "id": f["id"], "request_id": "x", "queue_depth": 0}))
                route.send(json.dumps({"type": "token", "id": f["id"], "index": 0, "text": "Hel"}))
                route.close(code=1011, reason="gateway going away")

        route.on_message(on_message)

    try:
        page = w.page
        if not hasattr(page, "route_web_socket"):
            pytest.skip("Playwright too old for page.route_web_socket (needs >= 1.48)")
        page.route_web_socket(re.compile(r"/v1/stream"), handler)
        w.open()

        page.fill("#prompt", "flood")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text("error")
        box = page.locator("#error")
        expect(box).to_be_visible()
        expect(box).to_contain_text("rate_limited")
        expect(box).to_contain_text("429")
        expect(box).to_contain_text("too many requests for this key")
        expect(box).to_contain_text("retry after 1.5 s")

        # the socket drops mid-stream: the request ends in an error, and the page reconnects
        page.fill("#prompt", "hello")
        page.click("#generate")
        expect(page.locator("#status")).to_have_text("error")
        expect(page.locator("#output")).to_have_text("Hel")
        expect(box).to_contain_text("connection_closed")
        expect(page.locator("#conn")).to_have_attribute("data-state", "open")
        assert len(conns) == 2

        # an API key: a fresh socket with ?api_key=, and /v1/models asked with the key
        with page.expect_request(re.compile(r"/v1/models$")) as models_request:
            page.fill("#api-key", "sk-test key")
            page.press("#api-key", "Tab")
        assert models_request.value.headers.get("authorization") == "Bearer sk-test key"
        expect(page.locator("#conn")).to_have_attribute("data-state", "open")
        assert len(conns) == 3 and conns[2].endswith("/v1/stream?api_key=sk-test%20key"), conns
        assert not w.errors, w.errors
    finally:
        w.close()


def test_microphone_transcribes_speech(fleet, mic_browser, tmp_path):
    """Mic on, two sentences spoken, Stop: the page shows partials while they are spoken,
    then a final for each; it sent what the voice protocol asks for, in that protocol's order."""
    gw = fleet.gateway()
    fleet.worker(model="asr-en")
    w = PageWatch(mic_browser, gw.http, permissions=("microphone",))
    try:
        page = w.page
        w.open()  # /v1/models lists only a speech model: the text form falls back to tiny-gpt
        assert page.locator("#model option[value=asr-en]").count() == 0
        expect(page.locator("#voice-status")).to_have_text("idle")
        page.click("#mic")
        expect(page.locator("#mic")).to_have_text("Stop")
        # the speech (from 2 s on) is seen, and partials show while it lasts
        expect(page.locator("#voice-status")).to_have_text("speaking", timeout=30_000)
        expect(page.locator("#partial")).to_have_text(re.compile(r"\S"), timeout=30_000)
        items = page.locator("#finals li")
        expect(items.nth(1)).to_have_text(re.compile(r"\S"), timeout=60_000)
        assert [items.nth(k).get_attribute("data-utterance") for k in range(2)] == ["0", "1"]
        hypotheses = [items.nth(k).text_content() for k in range(2)]
        errors = sum(wer(ref, hyp) * len(ref.split()) for ref, hyp in zip(MIC_SENTENCES, hypotheses))
        assert errors / sum(len(ref.split()) for ref in MIC_SENTENCES) <= 0.2, hypotheses
        assert page.text_content("#partial") == ""  # the final replaced the utterance's partial
        expect(page.locator("#voice-status")).to_have_text("listening")  # the speech is over
        page.screenshot(path=str(tmp_path / "demo-mic.png"), full_page=True)

        page.click("#mic")
        expect(page.locator("#voice-status")).to_have_text("idle", timeout=30_000)
        expect(page.locator("#mic")).to_have_text("Mic")
        assert page.locator("#finals li").count() == 2
        assert page.is_hidden("#voice-error")

        # the protocol, as the page spoke it
        assert w.websockets[-1] == gw.ws.replace("/v1/stream", "/v1/audio/stream")
        voice = w.timelines["/v1/audio/stream"]
        assert voice[0] == "sent:start" and voice[-1] == "received:stopped", voice
        assert {"type": "start", "model": "asr-en", "sample_rate": 16000, "encoding": "pcm_s16le"} in w.sent
        # audio only between "started" and "stop", a partial before the final, no errors
        first_audio, last_audio = voice.index("sent:audio"), len(voice) - 1 - voice[::-1].index("sent:audio")
        assert voice.index("received:started") < first_audio and last_audio < voice.index("sent:stop"), voice
        assert voice.index("received:partial") < voice.index("received:final"), voice
        assert "received:error" not in voice
        finals = [f for f in w.received if f.get("type") == "final"]
        assert [f["text"] for f in finals] == hypotheses
        # 16 kHz PCM16 in 10-100 ms frames of whole samples, up to the utterance's end at least
        assert w.audio_sent and all(320 <= n <= 3200 and n % 2 == 0 for n in w.audio_sent), set(w.audio_sent)
        assert sum(w.audio_sent) / 32 >= finals[-1]["end_ms"], (sum(w.audio_sent), finals[-1])
        w.assert_same_origin_only()
        assert not w.errors, w.errors
    finally:
        w.close()


def test_microphone_refused_is_explained(fleet, browser):
    """The microphone is not allowed (the context has no permission for it, and nothing
    grants it: in headless Chromium that is a refusal): the voice box says so, no voice
    socket opens, and the button can be tried again."""
    gw = fleet.gateway()
    w = PageWatch(browser, gw.http)
    try:
        page = w.page
        w.open()
        page.click("#mic")
        expect(page.locator("#voice-status")).to_have_text("error")
        box = page.locator("#voice-error")
        expect(box).to_be_visible()
        expect(box).to_contain_text("microphone_unavailable")
        expect(box).to_contain_text("the browser refused the microphone")
        expect(page.locator("#mic")).to_have_text("Mic")
        assert page.is_enabled("#mic")
        assert len(w.websockets) == 1  # only the text socket
        assert not w.errors, w.errors
    finally:
        w.close()
