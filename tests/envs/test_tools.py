"""Tools by name or import path, the call syntax, and calls that fail without failing the run."""

import concurrent.futures as cf
import threading
import time

import pytest

import fixtures_tools
from cadence.envs import (
    Budget,
    MalformedCall,
    ToolBox,
    ToolEnv,
    load_tool,
    load_tools,
    parse_call,
)
from cadence.types import Prompt


def test_parse_call():
    assert parse_call("12 apples") is None
    assert parse_call("<call>calculator: 3 + 4</call>") == ("calculator", "3 + 4")
    assert parse_call("so <call> calculator :1+1</call>tail") == ("calculator", "1+1")
    for bad in ["<call>3 + 4</call>", "<call>calculator: 3 + 4", "<call>9x: 1</call>"]:
        with pytest.raises(MalformedCall, match="malformed call"):
            parse_call(bad)
    with pytest.raises(MalformedCall, match="longer than 1000"):
        parse_call(f"<call>echo: {'a' * 1001}</call>")


def test_tools_load_by_name_and_import_path():
    name, fn = load_tool("fixtures_tools:echo")
    assert name == "echo" and fn("x") == "echo x"
    assert list(load_tools(["calculator", "fixtures_tools:echo"])) == ["calculator", "echo"]
    with pytest.raises(ValueError, match="two tools are called 'echo'"):
        load_tools(["fixtures_tools:echo", "fixtures_tools:echo"])
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_tool("no_such_module:f")
    with pytest.raises(ValueError, match="has no function 'NOT_CALLABLE'"):
        load_tool("fixtures_tools:NOT_CALLABLE")
    with pytest.raises(ValueError, match="must be one of"):
        load_tool("abacus")
    with pytest.raises(ValueError, match="at least one tool"):
        load_tools([])


def _box(timeout_s=5.0):
    return ToolBox(
        load_tools(
            [
                "calculator",
                "fixtures_tools:boom",
                "fixtures_tools:garbage",
                "fixtures_tools:hang",
            ]
        ),
        timeout_s,
    )


def test_a_tool_that_raises_returns_garbage_or_hangs_gives_an_error_reply():
    fixtures_tools.RELEASE.clear()  # hang until the end of the test
    box = _box(timeout_s=0.3)
    ok = box.call("calculator", "3 + 4")
    assert (ok.reply, ok.error, ok.timeout) == ("<result>7</result>", False, False)
    raised = box.call("boom", "x")
    assert raised.reply == "<result>error: RuntimeError: boom on 'x'</result>" and raised.error
    junk = box.call("garbage", "x")
    assert junk.reply == "<result>error: garbage returned dict, not str</result>" and junk.error
    unknown = box.call("abacus", "1")
    assert "unknown tool 'abacus'; tools: boom, calculator, garbage, hang" in unknown.reply
    start = time.perf_counter()
    hung = box.call("hang", "x")
    waited = time.perf_counter() - start
    assert hung.timeout and hung.error
    assert hung.reply == "<result>error: hang timed out after 0.3s</result>"
    assert 0.3 <= waited < 2.0  # cut off at the timeout, not at the tool's 60 s
    assert hung.start <= hung.end
    bad_input = box.call("calculator", "import os")
    assert bad_input.reply.startswith("<result>error: CalculatorError:") and bad_input.error
    fixtures_tools.RELEASE.set()  # let the hung thread end


def test_the_tool_episode_counts_calls_errors_and_timeouts():
    fixtures_tools.RELEASE.clear()
    env = ToolEnv(_box().tools, Budget(4, 64), timeout_s=0.2)
    episode = env.start(Prompt("p", "q", "1"))
    final = episode.step("#### 7")
    assert final.done and final.reward is None and final.tool_calls == 0
    good = episode.step("<call>calculator: 3 + 4</call>")
    assert (good.text, good.done, good.tool_calls, good.tool_errors) == (
        "<result>7</result>",
        False,
        1,
        0,
    )
    assert [name for name, _, _ in good.spans] == ["tool"]
    malformed = episode.step("<call>calculator 3 + 4</call>")
    assert (malformed.tool_calls, malformed.tool_errors, malformed.done) == (1, 1, False)
    assert "malformed call" in malformed.text
    hung = episode.step("<call>hang: 1</call>")
    assert (hung.tool_calls, hung.tool_errors, hung.tool_timeouts) == (1, 1, 1)
    fixtures_tools.RELEASE.set()
    assert env.stop == ("</call>",)


def _tool_threads(name):
    return [t for t in threading.enumerate() if t.name == f"cadence-tool-{name}"]


def test_a_tool_that_always_hangs_holds_a_bounded_number_of_threads():
    fixtures_tools.RELEASE.set()  # hung calls of earlier tests end first
    for t in _tool_threads("hang"):
        t.join(timeout=5)
    assert not _tool_threads("hang")
    fixtures_tools.RELEASE.clear()
    box = ToolBox(load_tools(["calculator", "fixtures_tools:hang"]), 0.05, max_threads=3)
    try:
        with cf.ThreadPoolExecutor(4) as pool:  # as the episodes of a worker call it, at once
            outcomes = list(pool.map(lambda _: box.call("hang", "x"), range(24)))
        for hung in outcomes:  # every call still ends at its timeout, with the tool's error
            assert (hung.reply, hung.error, hung.timeout) == (
                "<result>error: hang timed out after 0.05s</result>",
                True,
                True,
            )
            assert hung.end - hung.start < 1.0
        assert len(_tool_threads("hang")) == 3  # not one per call
        ok = box.call("calculator", "3 + 4")  # another tool is not held up by the hung one
        assert (ok.reply, ok.timeout) == ("<result>7</result>", False)
    finally:
        fixtures_tools.RELEASE.set()
    for t in _tool_threads("hang"):
        t.join(timeout=5)
    assert box.call("hang", "x").reply == "<result>too late</result>"  # its threads came back
    with pytest.raises(ValueError, match="max_threads must be at least 1, got 0"):
        ToolBox(box.tools, 1.0, max_threads=0)
