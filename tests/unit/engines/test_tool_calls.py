import json

import pytest

from miles_ray.contracts import protocol_gaps
from miles_ray.engines.tool_calls import (
    HermesToolParser,
    ToolCall,
    ToolCallParser,
    chat_template,
    tool_call_parser,
)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression":"12*34"}}\n</tool_call>'


def test_hermes_parses_calls_and_keeps_the_arguments_as_written():
    parser = HermesToolParser()
    content, [call] = parser.parse("Let me compute.\n" + CALL)
    assert content == "Let me compute.\n" and call.name == "calculator"
    assert call.arguments == '{"expression":"12*34"}'  # verbatim (no space added): the next prompt repeats it
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression":"12*34"}'},
    }
    _, calls = parser.parse(CALL + "\n" + CALL.replace("12*34", "1+1"))
    assert [json.loads(c.arguments)["expression"] for c in calls] == ["12*34", "1+1"] and calls[0].id != calls[1].id
    content, [unclosed] = parser.parse('<tool_call>\n{"name": "f", "arguments": {}}\n')  # a stop string ended it
    assert (content, unclosed.name, unclosed.arguments) == ("", "f", "{}")


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["f"]\n</tool_call>',
        CALL + "\n<tool_call>\n{broken\n</tool_call>",  # one bad call voids the parse
    ],
)
def test_text_that_does_not_parse_stays_content(text):
    assert HermesToolParser().parse(text) == (text, [])


def test_forced_prefix_opens_a_call_the_parser_reads():
    parser = HermesToolParser()
    text = parser.forced_prefix("calculator") + '{"expression": "2+3"}}\n</tool_call>'
    [call] = parser.parse(text)[1]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2+3"}
    assert parser.parse(parser.forced_prefix(None) + 'f", "arguments": {}}')[1][0].name == "f"


class UpperParser:  # a user's parser, selected by import path
    start = "CALL:"

    def parse(self, text):
        head, sep, name = text.partition(self.start)
        return (text, []) if not sep else (head, [ToolCall(name.strip(), "{}")])

    def forced_prefix(self, name):
        return self.start + (name or "")


def test_parsers_by_name_or_import_path_fail_at_config_time():
    from miles_ray.engines.http_server import HttpServerConfig

    assert isinstance(tool_call_parser("hermes"), HermesToolParser)
    assert protocol_gaps(HermesToolParser, ToolCallParser) == protocol_gaps(UpperParser, ToolCallParser) == []
    custom = tool_call_parser(f"{__name__}:UpperParser")
    assert isinstance(custom, UpperParser) and custom.parse("x CALL: f")[1][0].name == "f"
    with pytest.raises(ValueError, match="tool_call_parser must be one of \\['hermes'\\]"):
        tool_call_parser("mistral")
    with pytest.raises(ValueError, match="is no ToolCallParser: .*parse: method missing"):
        tool_call_parser("collections:OrderedDict")
    with pytest.raises(ValueError, match="tool_call_parser"):
        HttpServerConfig(tool_call_parser="nowhere.module:Parser")
    with pytest.raises(ValueError, match="chat_template must be one of \\['chatml_tools'\\]"):
        HttpServerConfig(chat_template="/no/such/template.jinja")


def test_chatml_tools_template_round_trips_a_sampled_call(tiny_model_path):
    """Rendering the parsed call back gives the tokens the model sampled (no re-tokenisation drift), and without
    tools the template is SmolLM2's own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    template = chat_template("chatml_tools")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is 12*34?"}]
    assert tok.apply_chat_template(messages, chat_template=template, tokenize=False) == tok.apply_chat_template(
        messages, tokenize=False
    )
    prompt = tok.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt
    sampled = CALL  # what the policy wrote, then its end-of-turn token
    content, calls = HermesToolParser().parse(sampled)
    turn = {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
    result = {"role": "tool", "tool_call_id": calls[0].id, "content": "408"}
    again = tok.apply_chat_template(
        messages + [turn, result], tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert again.startswith(prompt + sampled + "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response>")
