"""Tool-call protocol parsing (incl. malformed input), the calculator's safety, lookup and BM25 search."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas_hpc.env.tools import (Bm25Index, Calculator, CalculatorLimits, Document, Lookup, Search, ToolBox,
                                   ToolCall, ToolError, parse_compact_call, parse_tool_calls)
from marlaas_hpc.tasks import Sample

SAMPLE = Sample(0, "p", "a", {"table": {"c4": 23}})


def test_parse_well_formed_calls_in_order():
    text = 'think <tool name="search">capital of France</tool> and <tool name = \'calculator\' >2 * 3</tool>'
    assert parse_tool_calls(text) == [ToolCall("search", "capital of France"), ToolCall("calculator", "2 * 3")]


def test_turn_without_tool_tag_is_not_a_call():
    assert parse_tool_calls("The answer is 42. <toolbox> is not a tag") == []


@pytest.mark.parametrize("text, reason", [
    ('<tool name="search">no closing tag', "missing </tool>"),
    ("<tool>query</tool>", "without name"),
    ('<tool name=search>query</tool>', "without name"),
    ('<tool name="search"', "unterminated"),
    ('<tool name="a"><tool name="b">x</tool></tool>', "nested"),
    ('<tool name="no spaces allowed">x</tool>', "invalid tool name"),
])
def test_malformed_calls_become_errors(text, reason):
    calls = parse_tool_calls(text)
    assert calls and calls[0].error is not None and reason in calls[0].error


def test_too_many_calls_and_long_arguments_are_errors():
    calls = parse_tool_calls('<tool name="x">1</tool>' * 6, max_calls=4)
    assert [c.error for c in calls[:4]] == [None] * 4 and "more than 4" in calls[4].error and len(calls) == 5
    assert "longer than" in parse_tool_calls(f'<tool name="x">{"a" * 50}</tool>', max_argument_chars=10)[0].error


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<tool name="x">/ \n\'=abc')), max_size=80) | st.text(max_size=80))
def test_parser_never_raises(text):
    for call in parse_tool_calls(text):
        assert isinstance(call, ToolCall)
    box = ToolBox([Calculator()])
    for call in parse_tool_calls(text):
        assert isinstance(box.call(call, SAMPLE).text, str)


def test_compact_syntax():
    assert parse_compact_call(" ?c4 ", "lookup") == ToolCall("lookup", "c4")
    assert parse_compact_call("?", "lookup") == ToolCall("lookup", "")
    assert parse_compact_call("40", "lookup") is None


@pytest.mark.parametrize("expr, value", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("2^10", "1024"),
    ("-3 ** 2", "-9"), ("1,000 * $3", "3000"), ("sqrt(16) + abs(-2)", "6"), ("0.1 + 0.2", "0.3"),
    ("round(2.675, 2)", "2.67"), ("max(1, 5, 3)", "5"), ("48 / 2", "24")])
def test_calculator_arithmetic(expr, value):
    assert Calculator().run(expr) == value


@pytest.mark.parametrize("expr", [
    "__import__('os').system('echo hi')", "open('/etc/passwd').read()", "(1).__class__", "x + 1",
    "[1, 2]", "lambda: 1", "'a' * 3", "9 ** 9 ** 9", "10 ** 1000", "2 ** 100000", "1e308 * 10", "1 / 0",
    "sqrt(-1)", "", "1 +", "(" * 200 + "1" + ")" * 200, "+".join(["1"] * 100), "True + 1", "max()"])
def test_calculator_refuses_unsafe_or_unbounded(expr):
    with pytest.raises(ToolError):
        Calculator(CalculatorLimits()).run(expr)


def test_calculator_errors_are_observations_not_crashes():
    outcome = ToolBox([Calculator()]).call(ToolCall("calculator", "1/0"), SAMPLE)
    assert not outcome.ok and outcome.text == "error: division by zero"
    outcome = ToolBox([Calculator()]).call(ToolCall("search", "x"), SAMPLE)
    assert not outcome.ok and "unknown tool 'search'" in outcome.text


def test_lookup_reads_the_samples_own_table():
    assert Lookup().run("c4", SAMPLE) == "23"
    with pytest.raises(ToolError):
        Lookup().run("c5", SAMPLE)


def test_bm25_search_ranks_the_relevant_document_first():
    docs = [Document("Paris", "Paris is the capital and largest city of France."),
            Document("Berlin", "Berlin is the capital of Germany."),
            Document("Photosynthesis", "Plants convert light into chemical energy.")]
    search = Search(Bm25Index(docs), k=2, max_chars=20)
    result = search.run("capital of France")
    assert result.startswith("[1] Paris: Paris is the capi...") and len(result.splitlines()) == 2
    assert search.run("the of and") == "no results"  # only stop words
    with pytest.raises(ToolError):
        search.run("   ")
    with pytest.raises(ValueError):
        Bm25Index([])
